"""Messages that say the value and what was expected (class 15 of docs/reliability.md), through the CLI.

Each case is a value an operator can write (a ``tuned:`` field, an environment variable); the answer
must be one located problem naming the value and what was expected, never an internal error text.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantreg import cli, doctor
from quantreg.host import host_facts


def _validate(tmp_path: Path, tuned: str, capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    path = tmp_path / "t.yaml"
    path.write_text(textwrap.dedent(f"""\
        version: 1
        rules:
          - match: {{device: cpu}}
            method: vllm
            tuned: {tuned}
        """), encoding="utf-8")
    capsys.readouterr()
    status = cli.main(["validate", "--json", str(path)])
    problems: list[dict[str, object]] = json.loads(capsys.readouterr().out)["problems"]
    assert status == 1 and problems
    return problems


@pytest.mark.parametrize("tuned,key,expected", [
    ("[1, 2]", "rules[0].tuned", "expected a mapping written by 'quantreg tune'"),
    ("{results: [], colour: red}", "rules[0].tuned.colour", "unknown key"),
    ("{at: 3, results: []}", "rules[0].tuned.at", "expected a string"),
    ("{results: {a: 1}}", "rules[0].tuned.results", "expected a list"),
    ("{results: [{method: m, ok: maybe}]}", "rules[0].tuned.results[0].ok", "expected true or false"),
    ("{results: [{method: m, ok: true, ms: {one: 2}}]}", "rules[0].tuned.results[0].ms",
     "token count -> milliseconds"),
    ("{phase_weights: {1: -1}, results: []}", "rules[0].tuned.phase_weights", "weight >= 0"),
    ("{budget_s: 0, results: []}", "rules[0].tuned.budget_s", "positive number"),
    ('{results: [{method: m, ok: true, ms: {"²": 1.0}}]}', "rules[0].tuned.results[0].ms", "token count"),
    ('{phase_weights: {"²": 1}, results: []}', "rules[0].tuned.phase_weights", "token count"),
    ("{rounds: -3, results: []}", "rules[0].tuned.rounds",
     "expected a whole number from 0 to 2,147,483,647, got integer -3"),
    ("{rounds: 2.5, results: []}", "rules[0].tuned.rounds", "got number 2.5"),
    ("{crossover: 32, results: []}", "rules[0].tuned.crossover", "expected {tokens: N, small: METHOD"),
    ("{crossover: {tokens: 32, small: a}, results: []}", "rules[0].tuned.crossover", "large missing"),
    ("{crossover: {tokens: '32', small: a, large: b}, results: []}", "rules[0].tuned.crossover",
     "tokens: expected a token count from 1 to 2,147,483,647, got string '32'"),
    ("{crossover: {tokens: 32, small: a, large: b, bound: 3}, results: []}", "rules[0].tuned.crossover",
     "unknown key 'bound'"),
    ("{crossover: {tokens: 32, small: a, large: b, worst_ratio: -1}, results: []}", "rules[0].tuned.crossover",
     "worst_ratio: expected a positive number"),
])
def test_tuned_values_say_the_value_and_what_was_expected(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          tuned: str, key: str, expected: str) -> None:
    [problem] = _validate(tmp_path, tuned, capsys)
    assert problem["key"] == key and expected in str(problem["message"]) and problem["line"], problem
    assert str(problem["text"]).startswith(f"{tmp_path / 't.yaml'}:"), problem  # located: path:line: key: ...


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.text(min_size=1, max_size=4).filter(lambda k: not (k.isascii() and k.isdigit() and int(k) > 0)))
def test_any_non_count_ms_key_is_a_located_problem(tmp_path_factory: pytest.TempPathFactory,
                                                    capsys: pytest.CaptureFixture[str], key: str) -> None:
    tuned = "{results: [{method: m, ok: true, ms: {" + json.dumps(key) + ": 1.0}}]}"
    problems = _validate(tmp_path_factory.mktemp("t"), tuned, capsys)
    assert all(p["line"] and "ValueError" not in str(p["message"]) for p in problems), problems


@pytest.mark.parametrize("spec", [",", " , ,", ",,"])
def test_flags_naming_no_flag_are_a_problem_not_no_flags(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str], spec: str) -> None:
    monkeypatch.delenv("QUANTREG_HOST_CPU_FLAGS", raising=False)
    real = host_facts().cpu_flags
    monkeypatch.setenv("QUANTREG_HOST_CPU_FLAGS", spec)
    facts = host_facts()
    assert facts.cpu_flags == real and not facts.simulated
    capsys.readouterr()
    cli.main(["rules", "--json"])
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert any(p["key"] == "QUANTREG_HOST_CPU_FLAGS" and "names none" in str(p["message"]) for p in problems)
    monkeypatch.setenv("QUANTREG_HOST_CPU_FLAGS", "")
    assert host_facts().cpu_flags == real  # empty is unset, as everywhere


# -- issue 46, class 6: the listed messages, and one word for a table's precedence tier --------------------


def _table(path: Path, body: str) -> Path:
    path.write_text("version: 1\nrules:\n" + textwrap.dedent(body), encoding="utf-8")
    return path


def test_a_dense_verify_against_a_method_can_never_run_and_is_a_located_problem(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _table(tmp_path / "d.yaml", """\
          - match: {quant_format: gpt_oss_mxfp4, layer: lm_head}
            method: vllm
            verify: {against: some_method}
        """)
    status = cli.main(["validate", "--json", str(path)])
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert status == 1
    [found] = [p for p in problems if p["key"] == "rules[0].verify.against"]
    assert found["line"] == 5 and "can never run: the rule decides lm_head layers, which verify against 'float64' " \
        "only, not a second method 'some_method'" in found["message"], found


def test_doctor_lists_a_dense_rule_for_every_value_of_a_list_field(tmp_path: Path) -> None:
    """A list-valued match field was shown as ``*`` and resolved to ``vllm [no rule]`` for a rule that decides."""
    from quantreg.registry import Registry

    path = _table(tmp_path / "d.yaml", """\
          - match: {quant_format: [fp8, gpt_oss_mxfp4], model_type: gpt_oss, device: cpu, layer: lm_head}
            method: vllm
        """)
    registry = Registry.build(config=[path], env={}, entry_points=False)
    lines = doctor._dense_decisions(registry, "cpu")
    assert [(d["key"], d["rule"]) for d in lines] == [
        ("(fp8, gpt_oss, cpu, lm_head)", f"{path}:3"), ("(gpt_oss_mxfp4, gpt_oss, cpu, lm_head)", f"{path}:3")]


def test_an_ambiguity_leaves_out_both_files_and_left_out_names_both(tmp_path: Path) -> None:
    from quantreg.envelope import left_out
    from quantreg.registry import Registry

    rule = "  - match: {quant_format: fp8}\n    method: vllm\n"
    a, b = (_table(tmp_path / f"{n}.yaml", rule) for n in "ab")
    registry = Registry.build(config=[a, b], env={}, entry_points=False)
    assert {t.path for t in registry.tables}.isdisjoint({str(a), str(b)})
    assert sorted(f["path"] for f in left_out(registry, [str(a), str(b)])) == [str(a), str(b)]


def test_a_strict_failure_inside_a_dense_load_has_one_prefix() -> None:
    """A ``verify:`` load check refusing in strict mode (one ``quantreg (strict):`` line) passed through the dense
    seam's loading containment, which wrapped it in a second ``quantreg (strict): ... QuantregError: quantreg
    (strict): ...``."""
    from types import SimpleNamespace

    from quantreg.keys import Key
    from quantreg.problems import QuantregError, strict_error
    from quantreg.vllm.dense import DenseSeam

    class Refusing:
        def process_weights_after_loading(self, layer: object) -> None:
            raise strict_error("verify: lm_head: error 0.3 exceeds tolerance 0.02; refusing to start")

    method = Refusing()
    decision = SimpleNamespace(method="m", key=Key("fp8", "x", "cpu", "lm_head"), source="t.yaml:3")
    DenseSeam._contain_loading(None, method, object(), SimpleNamespace(prefix="lm_head"), decision, True)  # type: ignore[arg-type]
    with pytest.raises(QuantregError) as raised:
        method.process_weights_after_loading(SimpleNamespace(prefix="lm_head"))
    assert str(raised.value) == ("quantreg (strict): verify: lm_head: error 0.3 exceeds tolerance 0.02; refusing "
                                 "to start")


def test_tiny_models_serve_hint_escapes_a_directory_name() -> None:
    from quantreg.tiny.command import serve_hint

    text = serve_hint(Path("model\x1b[31m\x07red"), bf16=False)
    assert "\x1b" not in text and "\x07" not in text and "\\x1b[31m" in text


def test_one_word_for_a_tables_precedence_tier_in_every_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """explain said "(user tier)" for a QUANTREG_CONFIG rule, validate's collision warning "[run]" for that file."""
    path = _table(tmp_path / "u.yaml", """\
          - match: {quant_format: fp8, model_type: m, device: cpu}
            method: vllm
          - match: {quant_format: fp8, model_type: m}
            method: vllm
        """)
    monkeypatch.setenv("QUANTREG_CONFIG", str(path))
    cli.main(["explain", "fp8", "m", "cpu"])
    explained = capsys.readouterr().out
    assert f"rule     {path}:3 (user tier) match" in explained
    assert f"WON  {path}:3 [user tier, specificity 3, priority 0]" in explained
    assert f"lost {path}:5 [user tier, specificity 2, priority 0]" in explained
    monkeypatch.delenv("QUANTREG_CONFIG")
    other = _table(tmp_path / "plugin-like.yaml", "  - match: {quant_format: fp8}\n    method: vllm\n")
    from quantreg.registry import Registry

    for warning in Registry.build(config=[other], env={"QUANTREG_CONFIG": str(path)}).collisions():
        assert "[user tier]" in warning or "[run tier]" in warning, warning
    cli.main(["validate", str(path)])
    for line in capsys.readouterr().err.splitlines():
        assert "[run]" not in line and "[user]" not in line, line


def test_tune_layers_names_non_finite_and_wrong_shaped_weights() -> None:
    """Before any layer is built: not vLLM's loader blamed for NaN weights, not ``KeyError: 'lm_head'``."""
    torch = pytest.importorskip("torch")
    from quantreg.testing.gpt_oss_dense import DenseShape
    from quantreg.tune.dense_measure import tensors_problem

    shape = DenseShape(hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=256, experts=4)
    good = torch.zeros(256, 64, dtype=torch.bfloat16)
    assert tensors_problem("lm_head", shape, {"lm_head": {"weight": good}}) is None
    nan = good.clone()
    nan[3, 5] = float("nan")
    assert tensors_problem("lm_head", shape, {"lm_head": {"weight": nan}}) == (
        "lm_head: weight holds 1 non-finite value(s) (NaN or inf); the float64 reference needs finite weights")
    assert tensors_problem("lm_head", shape, {"lm_head": {"weight": good[:, :32]}}) == (
        "lm_head: weight has shape [256, 32]; expected [256, 64] at these sizes")
    assert tensors_problem("lm_head", shape, {"lm_head": {}}) == "lm_head: tensor weight missing"
