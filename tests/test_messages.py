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

from quantreg import cli
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
    ('{results: [{method: m, ok: true, ms: {"²": 1.0}}]}', "rules[0].tuned.results[0].ms", "token count"),
    ('{phase_weights: {"²": 1}, results: []}', "rules[0].tuned.phase_weights", "token count"),
    ("{rounds: -3, results: []}", "rules[0].tuned.rounds", "expected a whole number from 0 to 2,147,483,647, got integer -3"),
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
