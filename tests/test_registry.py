"""Resolution: tiered precedence, ambiguity, decisions with reasons, availability, caching, and the
process-wide registry (strict mode, fingerprint).

Tables are real files. Methods come from a plugin object added with ``Registry.build(plugins=...)``
(registry_support.py; real entry points are covered in test_plugins.py). The brute-force reference
of the precedence is in test_registry_reference.py; method loading in test_methods_loading.py.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from registry_support import LAYER_METHODS, build, rules_yaml

from quantreg import Key, Method, Tier, get_registry, resolve, set_registry
from quantreg.installed import installed_vllm_version
from quantreg.loading import config_paths

pytestmark = pytest.mark.usefixtures("clean_env")


# -- precedence ----------------------------------------------------------------------------
def test_layers_default_plugin_user_run(table: Callable[[str, str], Path]) -> None:
    default = table("default.yaml", rules_yaml("{match: {}, method: m_default}"))
    plugin = table("plugin.yaml", rules_yaml("{match: {}, method: m_plugin}"))
    user = table("user.yaml", rules_yaml("{match: {}, method: m_user}"))
    run = table("run.yaml", rules_yaml("{match: {}, method: m_run}"))
    key = Key("fp8", "llama", "cpu")

    def winner(**kw: Any) -> str:
        registry = build(methods=LAYER_METHODS, default=default, **kw)
        assert registry.problems == ()
        return registry.resolve(key).method

    assert winner() == "m_default"
    assert winner(plugin_tables=[plugin]) == "m_plugin"
    assert winner(plugin_tables=[plugin], user=[user]) == "m_user"
    assert winner(plugin_tables=[plugin], user=[user], run=[run]) == "m_run"
    assert winner(run=[run]) == "m_run"

    registry = build(methods=LAYER_METHODS, default=default, plugin_tables=[plugin], user=[user], run=[run])
    decision = registry.resolve(key)
    assert [(c.rule.location, c.won, c.reason) for c in decision.candidates] == [
        (f"{run}:3", True, "highest precedence (tier, then specificity, then priority)"),
        (f"{user}:3", False, "lower tier (user < run)"),
        (f"{plugin}:3", False, "lower tier (plugin < run)"),
        (f"{default}:3", False, "lower tier (default < run)"),
    ]
    assert [t.tier for t in registry.tables] == [Tier.DEFAULT, Tier.PLUGIN, Tier.USER, Tier.RUN]


def test_user_file_overrides_any_builtin_decision(table: Callable[[str, str], Path]) -> None:
    """Even a catch-all user rule beats the most specific, highest-priority plugin rule."""
    plugin = table("plugin.yaml", rules_yaml(
        "{match: {quant_format: fp8, model_type: llama, device: cpu}, method: m_plugin, priority: 100}"))
    user = table("user.yaml", rules_yaml("{match: {}, method: m_user}"))
    registry = build(methods=LAYER_METHODS, plugin_tables=[plugin], user=[user])
    decision = registry.resolve(("fp8", "llama", "cpu"))
    assert decision.method == "m_user"
    assert decision.source == f"{user}:3"
    assert decision.candidates[1].reason == "lower tier (plugin < user)"


def test_user_file_overrides_the_packaged_default_table(table: Callable[[str, str], Path]) -> None:
    user = table("user.yaml", rules_yaml("{match: {device: hpu}, method: m_user}"))
    registry = build(methods=LAYER_METHODS, user=[user])  # the real registry.yaml as default tier
    assert registry.resolve(("gpt_oss_mxfp4", "gpt_oss", "hpu")).method == "m_user"
    decision = registry.resolve(("gpt_oss_mxfp4", "gpt_oss", "cpu"))
    assert decision.method == "vllm"
    assert decision.rule is not None and decision.rule.tier is Tier.DEFAULT
    assert decision.rule.path.endswith("registry.yaml")


def test_within_a_layer_specificity_then_priority(table: Callable[[str, str], Path]) -> None:
    user = table("user.yaml", rules_yaml(
        "{match: {device: cpu}, method: m_user, priority: 9}",
        "{match: {quant_format: fp8, device: cpu}, method: m_specific}",
        "{match: {model_type: llama}, method: m_user2, priority: 3}",
    ))
    registry = build(methods=LAYER_METHODS, user=[user])
    assert registry.problems == ()
    decision = registry.resolve(("fp8", "llama", "cpu"))
    assert decision.method == "m_specific"
    assert [(c.rule.line, c.reason) for c in decision.candidates[:3]] == [
        (4, "highest precedence (tier, then specificity, then priority)"),
        (3, "less specific (1 < 2 named fields)"),
        (5, "less specific (1 < 2 named fields)"),
    ]
    decision = registry.resolve(("int8", "llama", "cpu"))
    assert decision.method == "m_user"
    assert [(c.rule.line, c.reason) for c in decision.candidates[:2]] == [
        (3, "highest precedence (tier, then specificity, then priority)"),
        (5, "lower priority (3 < 9)"),
    ]


def test_quantreg_config_holds_several_files(table: Callable[[str, str], Path]) -> None:
    one = table("one.yaml", rules_yaml("{match: {device: cpu}, method: m_user}"))
    two = table("two.yaml", rules_yaml("{match: {device: hpu}, method: m_user2}"))
    env = {"QUANTREG_CONFIG": os.pathsep.join(["", str(one), " ", str(two), ""])}
    assert config_paths(env) == (str(one), str(two))
    registry = build(methods=LAYER_METHODS, env=env)
    assert registry.problems == ()
    assert [(t.path, t.tier) for t in registry.tables[1:]] == [(str(one), Tier.USER), (str(two), Tier.USER)]
    assert registry.resolve(("q", "m", "cpu")).method == "m_user"
    assert registry.resolve(("q", "m", "hpu")).method == "m_user2"


def test_ambiguity_across_two_files_of_one_layer(table: Callable[[str, str], Path]) -> None:
    one = table("one.yaml", rules_yaml("{match: {device: cpu}, method: m_user}",
                                       "{match: {device: [hpu, xpu]}, method: m_user}"))
    two = table("two.yaml", rules_yaml("{match: {quant_format: fp8}, method: m_user2}"))
    plugin = table("plugin.yaml", rules_yaml("{match: {device: cpu}, method: m_plugin}"))
    registry = build(methods=LAYER_METHODS, user=[one, two], plugin_tables=[plugin])
    messages = [str(p) for p in registry.problems]
    assert len(messages) == 2
    assert messages[0].startswith(f"{two}:3: rules[0].match: ambiguous: rule (fp8, *, *) and rule {one}:3 (*, *, cpu)")
    assert messages[1].startswith(f"{two}:3: rules[0].match: ambiguous: rule (fp8, *, *) and rule {one}:4 "
                                  "(*, *, [hpu|xpu])")
    assert "in the user tier" in messages[0]
    # both files are left out, the lower tiers answer
    assert {t.path for t in registry.tables}.isdisjoint({str(one), str(two)})
    assert registry.resolve(("fp8", "m", "cpu")).method == "m_plugin"


def test_ambiguity_inside_one_file_leaves_out_only_that_file(table: Callable[[str, str], Path]) -> None:
    bad = table("bad.yaml", rules_yaml("{match: {device: cpu}, method: m_user}",
                                       "{match: {model_type: llama}, method: m_user2}"))
    good = table("good.yaml", rules_yaml("{match: {device: cpu}, method: m_run}"))
    registry = build(methods=LAYER_METHODS, user=[bad], run=[good])
    [problem] = registry.problems
    assert (problem.path, problem.line, problem.key) == (str(bad), 4, "rules[1].match")
    assert f"{bad}:3" in problem.message
    assert [t.path for t in registry.tables][1:] == [str(good)]


def test_same_rules_in_different_layers_are_not_ambiguous(table: Callable[[str, str], Path]) -> None:
    user = table("user.yaml", rules_yaml("{match: {device: cpu}, method: m_user}"))
    run = table("run.yaml", rules_yaml("{match: {device: cpu}, method: m_run}"))
    registry = build(methods=LAYER_METHODS, user=[user], run=[run])
    assert registry.problems == ()
    assert registry.resolve(("q", "m", "cpu")).method == "m_run"


def test_a_broken_file_is_left_out_and_the_rest_stays(table: Callable[[str, str], Path], tmp_path: Path) -> None:
    broken = table("broken.yaml", rules_yaml("{match: {device: cpu}, method: m_user, priority: high}"))
    good = table("good.yaml", rules_yaml("{match: {device: cpu}, method: m_user2}"))
    missing = tmp_path / "missing.yaml"
    registry = build(methods=LAYER_METHODS, user=[broken, good, missing])
    assert [str(p) for p in registry.problems] == [
        f"{broken}:3: rules[0].priority: expected an integer from -1,000,000,000 to 1,000,000,000, got string 'high'",
        f"{missing}: no such file",
    ]
    assert registry.resolve(("q", "m", "cpu")).method == "m_user2"


def test_unknown_method_in_a_table(table: Callable[[str, str], Path]) -> None:
    user = table("user.yaml", rules_yaml("{match: {}, method: [m_user, m_usr]}"))
    registry = build(methods=LAYER_METHODS, user=[user])
    [problem] = registry.problems
    assert str(problem).startswith(f"{user}:3: rules[0].method: unknown method 'm_usr'; did you mean 'm_user'?")
    assert registry.resolve(("q", "m", "cpu")).method == "vllm"


# -- decisions -----------------------------------------------------------------------------
PROBES = """
calls = []


def yes():
    calls.append("yes")
    return True, "device answered"


def no():
    calls.append("no")
    return False, "no accelerator found"


def boom():
    raise RuntimeError("kaput")


def not_a_pair():
    return "yes"
"""


@pytest.fixture
def chain_methods(module_dir: Callable[[str, str], Path]) -> list[Method]:
    module_dir("qrt_probes", PROBES)
    module_dir("qrt_target", "class Target:\n    pass\n\n\ndef not_a_class():\n    pass\n")
    return [
        Method("on_hpu", "qrt_target:Target", devices=("hpu",)),
        Method("needs_mod", "qrt_target:Target", requires=("json", "qrt_definitely_missing_module")),
        Method("needs_new_vllm", "qrt_target:Target", vllm_version=">=999"),
        Method("probe_no", "qrt_target:Target", probe="qrt_probes:no"),
        Method("probe_boom", "qrt_target:Target", probe="qrt_probes:boom"),
        Method("probe_garbage", "qrt_target:Target", probe="qrt_probes:not_a_pair"),
        Method("probe_missing", "qrt_target:Target", probe="qrt_probes:nothing_here"),
        Method("probe_yes", "qrt_target:Target", devices=("cpu", "hpu"), probe="qrt_probes:yes"),
        Method("plain", "qrt_target:Target"),
        Method("later", "qrt_target:Target", probe="qrt_probes:boom"),
    ]


def test_chain_availability_with_reasons(table: Callable[[str, str], Path], chain_methods: list[Method]) -> None:
    user = table("user.yaml", rules_yaml(
        "{match: {device: cpu}, method: [on_hpu, needs_mod, needs_new_vllm, probe_no, probe_boom, probe_garbage, "
        "probe_missing, probe_yes, later], options: {chunk: 8}, note: try everything}"))
    registry = build(methods=chain_methods, user=[user])
    assert registry.problems == () and registry.failures == ()
    decision = registry.resolve(("fp8", "llama", "cpu"))
    vllm = installed_vllm_version()
    vllm_reason = ("requires vLLM >=999; vLLM is not installed" if vllm is None
                   else f"requires vLLM >=999; installed is {vllm}")
    assert [(s.method, s.available, s.reason) for s in decision.chain] == [
        ("on_hpu", False, "runs on hpu, not cpu"),
        ("needs_mod", False, "requires module 'qrt_definitely_missing_module', which is not installed"),
        ("needs_new_vllm", False, vllm_reason),
        ("probe_no", False, "no accelerator found"),
        ("probe_boom", False, "probe raised RuntimeError: kaput"),
        ("probe_garbage", False, "probe raised ValueError: too many values to unpack (expected 2)"),
        ("probe_missing", False, "probe raised ImportError: module 'qrt_probes' has no attribute 'nothing_here' "
                                 "(target qrt_probes:nothing_here)"),
        ("probe_yes", True, "device answered"),
        ("later", False, "not tried: 'probe_yes' came first"),
    ]
    assert all(s.plugin == "test-plugin" for s in decision.chain)
    assert decision.method == "probe_yes" and decision.fallback is None and not decision.keeps_vllm
    assert decision.options == {"chunk": 8}
    assert decision.summary() == f"(fp8, llama, cpu) -> probe_yes [{user}:3]"
    text = decision.render()
    assert f"rule     {user}:3 (user tier) match (*, *, cpu)" in text
    assert "note     try everything" in text
    assert "  no  on_hpu: passed over: runs on hpu, not cpu" in text and "  yes probe_yes: device answered" in text


def test_fallback_to_vllm_when_nothing_in_the_chain_can_run(table: Callable[[str, str], Path],
                                                            chain_methods: list[Method]) -> None:
    user = table("user.yaml", rules_yaml("{match: {device: xpu}, method: [on_hpu, probe_no, probe_yes]}"))
    registry = build(methods=chain_methods, user=[user])
    decision = registry.resolve(("fp8", "llama", "xpu"))
    assert decision.method == "vllm" and decision.keeps_vllm
    assert decision.fallback == "no method in the chain is available here; vLLM keeps its own method"
    assert [s.available for s in decision.chain] == [False, False, False]
    assert decision.chain[2].reason == "runs on cpu, hpu, not xpu"
    assert decision.rule is not None and decision.source == f"{user}:3"  # the rule still won
    assert "(fallback: no method in the chain" in decision.summary()
    assert "fallback no method in the chain" in decision.render()


def test_no_matching_rule_keeps_vllm(table: Callable[[str, str], Path]) -> None:
    default = table("default.yaml", rules_yaml("{match: {device: cpu}, method: vllm}"))
    registry = build(default=default)
    decision = registry.resolve(("fp8", "llama", "hpu"))
    assert (decision.method, decision.rule, decision.candidates, decision.chain) == ("vllm", None, (), ())
    assert decision.source == "no rule"
    assert "rule     none matched: vLLM keeps its own method" in decision.render()
    assert decision.to_json()["rule"] is None


def test_decisions_are_cached_per_key(table: Callable[[str, str], Path], chain_methods: list[Method]) -> None:
    user = table("user.yaml", rules_yaml("{match: {}, method: [probe_no, probe_yes]}"))
    registry = build(methods=chain_methods, user=[user])
    first = registry.resolve(Key("fp8", "llama", "cpu"))
    assert registry.resolve(("fp8", "llama", "cpu")) is first
    assert registry.resolve(Key("fp8", "llama", "cpu")) is first
    other = registry.resolve(("fp8", "qwen", "cpu"))
    assert other is not first and other.key == ("fp8", "qwen", "cpu")
    # probes run once per (method, device), however many keys ask
    probes = sys.modules["qrt_probes"]
    assert probes.calls == ["no", "yes"]
    registry.resolve(("int8", "llama", "hpu"))
    assert probes.calls == ["no", "yes", "no", "yes"]
    assert registry.availability("probe_yes", "cpu") is registry.availability("probe_yes", "cpu")
    assert registry.availability("nope", "cpu").reason == "not registered by any plugin"


def test_decision_json_is_complete(table: Callable[[str, str], Path]) -> None:
    user = table("user.yaml", rules_yaml("{match: {device: [cpu, hpu]}, method: [m_user], options: {k: [1]}}"))
    registry = build(methods=LAYER_METHODS, user=[user])
    data = json.loads(json.dumps(registry.resolve(("fp8", "llama", "cpu")).to_json()))
    assert data["key"] == {"quant_format": "fp8", "model_type": "llama", "device": "cpu"}
    assert data["method"] == "m_user" and data["options"] == {"k": [1]} and data["fallback"] is None
    assert data["rule"] == {"path": str(user), "line": 3, "tier": "user",
                            "match": {"quant_format": "*", "model_type": "*", "device": ["cpu", "hpu"]},
                            "method": ["m_user"], "options": {"k": [1]}, "priority": 0, "specificity": 1, "note": ""}
    assert [(c["rule"]["tier"], c["won"]) for c in data["candidates"]] == [("user", True), ("default", False)]
    assert data["candidates"][1]["reason"] == "lower tier (default < user)"
    assert data["chain"] == [{"method": "m_user", "available": True, "plugin": "test-plugin",
                              "reason": "no probe; device and requirements satisfied"}]


# -- the process-wide registry, strict mode, fingerprint ------------------------------------------
def test_process_wide_registry_reads_the_environment(table: Callable[[str, str], Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    user = table("user.yaml", rules_yaml("{match: {device: cpu}, method: vllm, note: from QUANTREG_CONFIG}"))
    monkeypatch.setenv("QUANTREG_CONFIG", str(user))
    monkeypatch.setenv("QUANTREG_PLUGINS", "")
    registry = get_registry()
    assert get_registry() is registry
    decision = resolve(("fp8", "llama", "cpu"))
    assert decision.source == f"{user}:3" and decision is registry.resolve(("fp8", "llama", "cpu"))
    set_registry(None)
    assert get_registry() is not registry


def test_strict_mode(table: Callable[[str, str], Path]) -> None:
    strict = table("strict.yaml", "version: 1\nstrict: true\nrules: []\n")
    assert not build().strict
    assert build(user=[strict]).strict
    assert build(env={"QUANTREG_STRICT": "1"}).strict
    assert not build(env={"QUANTREG_STRICT": "0"}).strict


def test_strict_mode_is_one_decision_from_every_source(table: Callable[[str, str], Path]) -> None:
    """decide_mode: env, user/run headers (kept, broken or left out by a tie, in any order), run strict."""
    from quantreg.mode import decide_mode

    rule = "  - match: {device: cpu}\n    method: vllm\n"
    tied_strict = table("a_strict.yaml", "version: 1\nstrict: true\nrules:\n" + rule)
    tied_plain = table("b_plain.yaml", "version: 1\nrules:\n" + rule)
    for user in ([tied_strict, tied_plain], [tied_plain, tied_strict]):  # both files are left out by the tie
        registry = build(user=user)
        assert [t.tier for t in registry.tables] == [Tier.DEFAULT] and registry.problems
        mode = registry.mode()
        assert mode.strict and mode.because == (f"strict: true in {tied_strict}",), user
    run_strict = table("run.yaml", "version: 1\nstrict: true\nrules: [}\n")  # not YAML: its raw text still asks
    assert build(run=[run_strict]).mode().because == (f"strict: true in {run_strict}",)  # issue 12 class 7
    broken_run = table("run2.yaml", "version: 1\nstrict: true\nrules: 5\n")
    assert build(run=[broken_run]).mode().because == (f"strict: true in {broken_run}",)
    lenient = build()
    assert not lenient.mode().strict and str(lenient.mode()) == "lenient"
    assert lenient.mode(run_strict=True).because == ('vLLM additional_config {"quantreg": {"strict": true}}',)
    assert not lenient.mode(run_strict=False).strict
    env_mode = build(env={"QUANTREG_STRICT": " Yes "}).mode(run_strict=False)  # strict is never switched off
    assert env_mode.strict and env_mode.because == ("QUANTREG_STRICT=Yes",)
    assert decide_mode({}, build(plugin_tables=[tied_strict]).headers).strict is False  # plugin tier: no say


def test_fingerprint_follows_the_effective_rules(table: Callable[[str, str], Path]) -> None:
    user = table("user.yaml", rules_yaml("{match: {device: cpu}, method: m_user}"))
    a = build(methods=LAYER_METHODS, user=[user]).fingerprint()
    assert a == build(methods=LAYER_METHODS, user=[user]).fingerprint()
    assert len(a) == 16
    user.write_text(rules_yaml("{match: {device: cpu}, method: m_user2}"), encoding="utf-8")
    assert build(methods=LAYER_METHODS, user=[user]).fingerprint() != a
