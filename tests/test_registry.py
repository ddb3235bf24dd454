"""Resolution: tiered precedence, ambiguity, decisions with reasons, availability, caching, laziness.

Tables are real files. Methods come from a plugin object added with ``Registry.build(plugins=...)``
(real entry points are covered in test_plugins.py). The last test compares ``resolve()`` with a
brute-force reading of the documented precedence on random tables.

Also here (issue 24 class 5): the determinism property over validating tables, from test_hardening.py.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations, product
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import quantreg
from quantreg import Key, Method, Registry, Tier, get_registry, resolve, set_registry
from quantreg.index import MAX_AMBIGUITIES
from quantreg.installed import installed_vllm_version, module_available
from quantreg.loading import config_paths
from quantreg.methods import BuildContext, load_object, version_satisfies
from quantreg.version_spec import check_specifier

pytestmark = pytest.mark.usefixtures("clean_env")


class MethodsPlugin:
    """An in-process plugin: registers the given methods and tables through the real hooks."""

    def __init__(self, methods: Iterable[Method], tables: Iterable[Path] = ()) -> None:
        self.methods = list(methods)
        self.tables = list(tables)

    @quantreg.hookimpl
    def register_methods(self, register: Callable[[Method], None]) -> None:
        for m in self.methods:
            register(m)

    @quantreg.hookimpl
    def register_tables(self, register: Callable[[Path | str], None]) -> None:
        for t in self.tables:
            register(t)


def anywhere(name: str, **kw: Any) -> Method:
    """A method that can run everywhere; its target is never imported by these tests."""
    return Method(name=name, target=f"qrt_never_imported:{name}", **kw)


def build(
    *,
    default: Path | None = None,
    plugin_tables: Sequence[Path] = (),
    user: Sequence[Path] = (),
    run: Sequence[Path] = (),
    methods: Iterable[Method] = (),
    env: dict[str, str] | None = None,
) -> Registry:
    env = dict(env or {})
    if user:
        env["QUANTREG_CONFIG"] = os.pathsep.join(map(str, user))
    return Registry.build(config=run, env=env, entry_points=False, default_table=default,
                          plugins=[("test-plugin", MethodsPlugin(methods, plugin_tables))])


def rules_yaml(*rules: str) -> str:
    """A table with one flow-style rule per line: rule ``i`` is on line ``i + 3``."""
    if not rules:
        return "version: 1\nrules: []\n"
    return "version: 1\nrules:\n" + "".join(f"  - {r}\n" for r in rules)


LAYER_METHODS = [anywhere(n) for n in ("m_default", "m_plugin", "m_user", "m_user2", "m_run", "m_specific")]


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


# -- methods: laziness and loading ------------------------------------------------------------
@pytest.mark.usefixtures("vllm_not_loaded")
def test_targets_and_probes_are_imported_only_when_needed(table: Callable[[str, str], Path],
                                                          module_dir: Callable[[str, str], Path]) -> None:
    module_dir("qrt_lazy_target", "class Fast:\n    pass\n")
    module_dir("qrt_lazy_probe", "def ok():\n    return True, 'fine'\n")
    module_dir("qrt_lazy_other_probe", "def ok():\n    return True, 'fine'\n")
    methods = [Method("fast", "qrt_lazy_target:Fast", probe="qrt_lazy_probe:ok"),
               Method("spare", "qrt_lazy_target:Fast", probe="qrt_lazy_other_probe:ok")]
    user = table("user.yaml", rules_yaml("{match: {device: cpu}, method: [fast, spare]}"))
    registry = build(methods=methods, user=[user])
    lazy = {"qrt_lazy_target", "qrt_lazy_probe", "qrt_lazy_other_probe"}
    assert lazy.isdisjoint(sys.modules)  # building the registry imports nothing
    registry.resolve(("q", "m", "hpu"))  # not matched by the rule: nothing probed
    assert lazy.isdisjoint(sys.modules)
    assert registry.resolve(("q", "m", "cpu")).method == "fast"
    assert "qrt_lazy_probe" in sys.modules  # probed
    assert "qrt_lazy_other_probe" not in sys.modules  # never tried
    assert "qrt_lazy_target" not in sys.modules  # chosen, but not built yet
    cls = registry.methods["fast"].load()
    assert "qrt_lazy_target" in sys.modules and cls.__name__ == "Fast"


def test_method_load_errors(module_dir: Callable[[str, str], Path]) -> None:
    module_dir("qrt_target", "class Target:\n    pass\n\n\ndef not_a_class():\n    pass\n")
    with pytest.raises(TypeError, match=r"target qrt_target:not_a_class is a function, not a class"):
        Method("m", "qrt_target:not_a_class").load()
    with pytest.raises(ImportError, match=r"module 'qrt_target' has no attribute 'Nope' \(target qrt_target:Nope\)"):
        Method("m", "qrt_target:Nope").load()
    with pytest.raises(ModuleNotFoundError):
        Method("m", "qrt_missing_module:X").load()
    with pytest.raises(ValueError, match=r"is not of the form 'package\.module:Name'"):
        load_object("qrt_target.Target")
    assert load_object("os.path:join") is os.path.join


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> type:
    """A stand-in ``vllm`` in sys.modules (never the real one: importing it takes seconds)."""
    base = type("FusedMoEMethodBase", (), {})
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.32.0+cpu"  # type: ignore[attr-defined]
    fused_moe = types.ModuleType("vllm.model_executor.layers.fused_moe")
    fused_moe.FusedMoEMethodBase = base  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.fused_moe", fused_moe)
    return base


def test_loaded_target_must_subclass_the_base_the_seam_passes(fake_vllm: type,
                                                              module_dir: Callable[[str, str], Path]) -> None:
    """The seam passes vLLM's base (:mod:`quantreg.vllm.platform`, here the stand-in's) into
    ``load``/``build``; the core checks against it and imports nothing of vLLM itself (issue 47)."""
    from quantreg.vllm.platform import fused_moe_method_base

    base = fused_moe_method_base()
    assert base is fake_vllm
    module_dir("qrt_methods", """
import sys

Base = sys.modules["vllm.model_executor.layers.fused_moe"].FusedMoEMethodBase


class Good(Base):
    pass


class Stray:
    pass
""")
    assert Method("good", "qrt_methods:Good").load(base=base).__name__ == "Good"
    with pytest.raises(TypeError, match="does not subclass vLLM's FusedMoEMethodBase"):
        Method("stray", "qrt_methods:Stray").load(base=base)
    with pytest.raises(TypeError, match="does not subclass vLLM's FusedMoEMethodBase"):
        Method("stray", "qrt_methods:Stray").build(None, BuildContext(Key("f", "m", "cpu"), "stray", "t:1"), base=base)
    assert Method("stray", "qrt_methods:Stray").load().__name__ == "Stray"  # no base given: no class check


@pytest.mark.usefixtures("vllm_not_loaded")
def test_without_vllm_loaded_any_class_is_accepted(module_dir: Callable[[str, str], Path]) -> None:
    module_dir("qrt_target", "class Target:\n    pass\n")
    assert Method("m", "qrt_target:Target").load().__name__ == "Target"
    assert "vllm" not in sys.modules


CONSTRUCTION_MODULE = """
class Plain:  # the original contract: cls(moe_config, **options)
    def __init__(self, moe, **options):
        self.moe, self.options = moe, options


class WithContext:  # opts in by naming the keyword
    def __init__(self, moe, quantreg_context=None, *, alpha=1.0):
        self.moe, self.context, self.alpha = moe, quantreg_context, alpha


class KeywordOnly:
    def __init__(self, moe, *, quantreg_context, **options):
        self.context, self.options = quantreg_context, options
"""


@pytest.mark.usefixtures("vllm_not_loaded")
def test_construction_contract_old_and_new_form(module_dir: Callable[[str, str], Path]) -> None:
    """Plain classes get ``cls(moe_config, **options)``; classes naming ``quantreg_context`` get the context too."""
    from quantreg.methods import BuildContext, wants_context

    module_dir("qrt_build", CONSTRUCTION_MODULE)
    layer = object()
    context = BuildContext(Key("gpt_oss_mxfp4", "gpt_oss", "cpu"), "m", "user.yaml:4", {"alpha": 1.5},
                           "model.layers.0.mlp.experts", layer)
    moe = object()
    plain = Method("m", "qrt_build:Plain").build(moe, context)
    assert plain.moe is moe and plain.options == {"alpha": 1.5}  # a **options catch-all never sees the context
    new = Method("m", "qrt_build:WithContext").build(moe, context)
    assert new.moe is moe and new.alpha == 1.5 and new.context is context
    assert (new.context.key.model_type, new.context.rule, new.context.prefix) == (
        "gpt_oss", "user.yaml:4", "model.layers.0.mlp.experts")
    assert new.context.layer is layer and dict(new.context.options) == {"alpha": 1.5}
    keyword_only = Method("m", "qrt_build:KeywordOnly").build(moe, context)
    assert keyword_only.context is context and keyword_only.options == {"alpha": 1.5}
    assert [wants_context(c) for c in (dict, int)] == [False, False]  # builtins: the plain form


def test_vllm_version_requirement(fake_vllm: type) -> None:
    assert installed_vllm_version() == "0.32.0+cpu"
    assert Method("m", "x:Y", vllm_version=">=0.30,<0.40").availability("cpu").ok
    avail = Method("m", "x:Y", vllm_version=">=0.33").availability("cpu")
    assert (avail.ok, avail.reason) == (False, "requires vLLM >=0.33; installed is 0.32.0+cpu")


@pytest.mark.usefixtures("vllm_not_loaded")
def test_installed_vllm_version_without_importing_vllm() -> None:
    from quantreg.installed import vllm_distribution

    dist = vllm_distribution()
    assert installed_vllm_version() == (dist[1] if dist else None)
    assert "vllm" not in sys.modules


@pytest.mark.parametrize(
    ("version", "spec", "ok"),
    [
        ("0.32.0", ">=0.30,<0.40", True),
        ("0.32.0+cpu", ">=0.32", True),
        ("0.32", "==0.32.0", True),
        ("0.32.1", "==0.32", False),
        ("0.40.0", ">=0.30,<0.40", False),
        ("0.29.9", ">0.29.8, <=0.29.9", True),
        ("1.0.0", "!=1.0", False),
        ("0.32.0", "~=0.32", False),
    ],
)
def test_version_satisfies(version: str, spec: str, ok: bool) -> None:
    assert version_satisfies(version, spec) is ok


def test_check_specifier() -> None:
    assert check_specifier(">=0.30, <0.40") is None
    assert check_specifier(">=0.30,,<0.40") == "cannot read version clause ''; expected e.g. '>=0.30,<0.40'"
    assert check_specifier("0.30") is not None


def test_module_available_does_not_import() -> None:
    assert module_available("json")
    assert not module_available("qrt_definitely_missing_module")
    assert not module_available("qrt_definitely_missing_module.sub")
    assert not module_available("")


def test_method_devices_and_vllm_is_always_available() -> None:
    m = Method("m", "x:Y", devices=("cpu", "hpu"))
    assert m.runs_on("cpu") and not m.runs_on("cuda")
    assert Method("m", "x:Y").runs_on("anything")
    assert Method("vllm", "x:Y", devices=("none",)).availability("cpu").ok


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


# -- brute-force reference of the documented precedence (doubles as the fuzz test) -----------------
QUANT = ("a", "b", "c")
MODELS = ("a", "b", "c")
DEVICES = ("cpu", "hpu", "xpu")
KEYS = [Key(*k) for k in product((*QUANT, "z"), (*MODELS, "z"), (*DEVICES, "z"))]
FUZZ_METHODS = [anywhere("m_any"), Method("m_cpu", "qrt_never_imported:X", devices=("cpu",)),
                Method("m_hpu", "qrt_never_imported:X", devices=("hpu",))]
RUNS_ON = {"m_any": set(DEVICES) | {"z"}, "m_cpu": {"cpu"}, "m_hpu": {"hpu"}, "vllm": set(DEVICES) | {"z"}}


@dataclass(frozen=True)
class RefRule:
    tier: int
    path: str
    line: int
    fields: tuple[frozenset[str] | None, frozenset[str] | None, frozenset[str] | None]
    chain: tuple[str, ...]
    priority: int

    @property
    def location(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def rank(self) -> tuple[int, int, int]:
        return (self.tier, sum(f is not None for f in self.fields), self.priority)

    def matches(self, key: Key) -> bool:
        return all(f is None or v in f for f, v in zip(self.fields, key))


def field_values(values: Sequence[str]) -> st.SearchStrategy[Any]:
    return st.one_of(st.just("*"), st.sampled_from(values), st.lists(st.sampled_from(values), min_size=1,
                                                                       max_size=3, unique=True))


fuzz_rules = st.fixed_dictionaries(
    {"match": st.fixed_dictionaries({}, optional={"quant_format": field_values(QUANT),
                                                  "model_type": field_values(MODELS),
                                                  "device": field_values(DEVICES)}),
     "method": st.lists(st.sampled_from(["m_any", "m_cpu", "m_hpu", "vllm"]), min_size=1, max_size=3, unique=True),
     "priority": st.integers(0, 2)},
)
files = st.lists(fuzz_rules, max_size=3)
layouts = st.fixed_dictionaries({
    Tier.DEFAULT: st.lists(files, min_size=1, max_size=1),
    Tier.PLUGIN: st.lists(files, max_size=2),
    Tier.USER: st.lists(files, max_size=2),
    Tier.RUN: st.lists(files, max_size=2),
})


def reference(tables: list[tuple[Tier, str, list[dict[str, Any]]]]) -> tuple[
        set[tuple[str, str]], dict[Key, tuple[str | None, str, list[str], bool]]]:
    """The documented precedence (docs/tables.md), read literally and checked by brute force over every key."""
    rules: list[RefRule] = []
    for layer, path, raw in tables:
        for i, r in enumerate(raw):
            fields = tuple(None if (v := r["match"].get(f, "*")) == "*" else frozenset([v] if isinstance(v, str) else v)
                           for f in ("quant_format", "model_type", "device"))
            rules.append(RefRule(int(layer), path, i + 3, fields, tuple(r["method"]), r["priority"]))  # type: ignore[arg-type]
    ambiguous = {(a.location, b.location) for a, b in combinations(rules, 2)
                 if a.rank == b.rank and any(a.matches(k) and b.matches(k) for k in KEYS)}
    left_out = {loc.rsplit(":", 1)[0] for pair in ambiguous for loc in pair}
    kept = [r for r in rules if r.path not in left_out]
    answers = {}
    for key in KEYS:
        matching = sorted((r for r in kept if r.matches(key)), key=lambda r: r.rank, reverse=True)
        if not matching:
            answers[key] = (None, "vllm", [], False)
            continue
        winner = matching[0]
        assert len(matching) == 1 or matching[1].rank < winner.rank  # ties were ambiguous and left out
        runnable = [m for m in winner.chain if key.device in RUNS_ON[m]]
        answers[key] = (winner.location, runnable[0] if runnable else "vllm", [r.location for r in matching],
                        not runnable)
    return ambiguous, answers


@settings(max_examples=120, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(layouts)
def test_resolve_agrees_with_a_brute_force_reference(layout: dict[Tier, list[list[dict[str, Any]]]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tables: list[tuple[Tier, str, list[dict[str, Any]]]] = []
        paths: dict[Tier, list[Path]] = {layer: [] for layer in Tier}
        for layer in Tier:
            for n, raw in enumerate(layout[layer]):
                path = Path(tmp) / f"{layer}{n}.yaml"
                path.write_text(rules_yaml(*(json.dumps(r) for r in raw)), encoding="utf-8")
                paths[layer].append(path)
                tables.append((layer, str(path), raw))
        registry = build(default=paths[Tier.DEFAULT][0], plugin_tables=paths[Tier.PLUGIN],
                         user=paths[Tier.USER], run=paths[Tier.RUN], methods=FUZZ_METHODS)
        ambiguous, answers = reference(tables)

        found = set()
        for p in registry.problems:
            assert re.fullmatch(r"rules\[\d+\]\.match", p.key) and "ambiguous" in p.message, str(p)
            earlier = p.message.split(" and rule ", 1)[1].split(" ", 1)[0]
            found.add((earlier, f"{p.path}:{p.line}"))
        assert found == ambiguous

        for key in KEYS:
            location, method, candidates, fallback = answers[key]
            decision = registry.resolve(key)
            assert decision.source == (location or "no rule"), key
            assert decision.method == method, key
            assert [c.rule.location for c in decision.candidates] == candidates, key
            assert (decision.fallback is not None) == fallback, key
            assert [c.won for c in decision.candidates] == [i == 0 for i in range(len(candidates))]


def test_every_ambiguous_file_is_left_out_beyond_the_report_limit(table: Callable[[str, str], Path]) -> None:
    """Ambiguity reports are capped; files tied beyond the cap must still be left out."""
    many = [f"{{match: {{device: d{i}}}, method: m_user}}" for i in range(MAX_AMBIGUITIES + 1)]
    a = table("a.yaml", rules_yaml(*many))
    b = table("b.yaml", rules_yaml(*many))
    c = table("c.yaml", rules_yaml("{match: {quant_format: fp8}, method: m_user}"))
    d = table("d.yaml", rules_yaml("{match: {quant_format: fp8}, method: m_user2}"))
    registry = build(methods=LAYER_METHODS, user=[a, b, c, d])
    assert {t.path for t in registry.tables}.isdisjoint(map(str, (a, b, c, d)))
    assert any(p.path == str(d) and f"{c}:3" in p.message for p in registry.problems)
    assert registry.resolve(("fp8", "m", "d0")).method == "vllm"


# -- from test_hardening.py (strict vs lenient, fault isolation, security) --------------------


names = st.sampled_from(["a", "b", "c"])


match_values = st.one_of(st.just("*"), names, st.lists(names, min_size=1, max_size=2, unique=True))


rules = st.lists(st.fixed_dictionaries({"quant_format": match_values, "device": match_values,
                                        "priority": st.integers(-1, 1)}), max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rules)
def test_tables_that_validate_resolve_every_key_deterministically(tmp_path: Path,
                                                                 rows: list[dict[str, object]]) -> None:
    import json

    body = "".join(f"  - match: {{quant_format: {json.dumps(r['quant_format'])}, device: {json.dumps(r['device'])}}}\n"
                   f"    method: vllm\n    priority: {r['priority']}\n" for r in rows)
    path = tmp_path / "t.yaml"
    path.write_text("version: 1\nrules:\n" + (body or "  []\n"))
    first = Registry.build(env={"QUANTREG_CONFIG": str(path)}, entry_points=False)
    if first.problems:  # only ambiguity can make these tables invalid, and then nothing of them applies
        assert all("ambiguous" in p.message for p in first.problems)
        assert all(t.path != str(path) for t in first.tables)
        return
    second = Registry.build(env={"QUANTREG_CONFIG": str(path)}, entry_points=False)
    for key in [(q, "m", d) for q in "abcz" for d in "abcz"]:
        a, b = first.resolve(key), second.resolve(key)
        assert (a.method, a.source) == (b.method, b.source)
        assert first.resolve(key) is a  # cached
