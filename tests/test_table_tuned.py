"""``tuned:`` (quantreg/table/tuned.py) read as written: every field checked where the table is read,
every reader of the evidence total (issue 46, class 1).

A hand-edited evidence field used to pass ``validate`` (only the shape of ``pins`` was checked) and
then stop ``explain``/``plan``/``doctor`` (``TypeError: 'int' object is not iterable``) and every MoE
layer at vLLM start-up. The properties below draw ``tuned:`` mappings whose fields are each either what
``quantreg tune`` writes or a hostile value (wrong type, huge or non-finite number, a string where a
list belongs, unknown keys), write them as real YAML files and read them through the real registry:

- the table reader either accepts the evidence or names each bad field at its own line
  (``FILE:LINE: rules[0].tuned.pins.cpu_flags: expected ...``), never an exception;
- every reader of evidence (``Registry.stale_evidence`` with and without a layer shape, the decision's
  rendering, the fingerprint, ``quantreg.answer``, ``TunedEvidence.summary``) answers, and ``stale_pins``
  given the raw mapping directly (a reader the table check did not guard) turns what it cannot read into
  a stale finding.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import QUANTREG
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantreg import Key, Registry
from quantreg.answer import answer
from quantreg.pins import running_pins, stale_pins
from quantreg.table.tuned import PIN_CHECKS, PIN_KEYS, pin_problems

pytestmark = pytest.mark.usefixtures("clean_env")

KEY = Key("fmt46", "model46", "cpu")
SHAPE = {"experts": 4, "hidden": 128, "intermediate": 128, "top_k": 2}

#: Values of every kind a hand edit leaves behind.
hostile = st.recursive(
    st.none() | st.booleans() | st.integers(-10**40, 10**40) | st.sampled_from([10**3000, -10**3000, 0, -1])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
    | st.sampled_from(["avx2", "0.32.0", "²", "9" * 50, "a" * 64]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | st.integers(0, 9), inner,
                                                                max_size=4),
    max_leaves=8)

#: What tune writes for each pinned field (a valid value, so a draw may leave a field untouched).
GOOD_PINS: dict[str, Any] = {
    "cpu_model": "Some CPU", "cpu_flags": ["avx2", "fma"], "bandwidth_gbs": 11.8, "vllm": "0.32.0",
    "torch": None, "quantreg": "0.1.0", "plugins": {"quantreg-x": "0.1"}, "kernels": {"m46": "0" * 64},
    "shape": dict(SHAPE),
}
pin_values = st.fixed_dictionaries({}, optional={k: st.just(v) | hostile for k, v in GOOD_PINS.items()}) | \
    st.dictionaries(st.sampled_from([*PIN_KEYS, "cpu_modle", "flags"]), hostile, max_size=4)
GOOD_TUNED: dict[str, Any] = {
    "at": "2026-12-01T22:10:00Z", "host": {"kind": "avx2", "cores": 2, "flags": ["avx2"], "simulated": False},
    "vllm": "0.32.0", "rounds": 3, "tolerance": 0.02, "budget_s": 60, "shape": {**SHAPE, "weights": "layer 0"},
    "phase_weights": {1: 0.5, 64: 0.25, 256: 0.25},
    "crossover": {"tokens": 32, "small": "m46", "large": "vllm", "worst_ratio": 1.01, "worst_at": 64},
}
tuned_values = st.fixed_dictionaries(
    {"results": st.just([{"method": "m46", "ok": True, "ms": {1: 1.5, 64: 9.0}}]) | hostile,
     "pins": pin_values},
    optional={k: st.just(v) | hostile for k, v in GOOD_TUNED.items()})


def write_table(path: Path, tuned: Any) -> Path:
    rule = {"match": {"quant_format": KEY[0], "model_type": KEY[1], "device": KEY[2]}, "method": ["vllm"],
            "tuned": tuned}
    path.write_text(yaml.safe_dump({"version": 1, "rules": [rule]}, sort_keys=False))
    return path


def read_everything(registry: Registry) -> None:
    """Every reader of a table's evidence, as explain, plan, doctor and the seam call them."""
    decision = registry.resolve(KEY)
    decision.render()
    json.dumps(decision.to_json(), default=str)
    registry.fingerprint()
    for rule in registry.index.rules:
        for shape in (None, SHAPE):
            for stale in registry.stale_evidence(rule, shape):
                assert stale.text()
        if rule.tuned is not None:
            assert rule.tuned.summary("vllm")
    answer(registry, KEY).line()


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tuned=tuned_values)
def test_every_tuned_field_is_checked_where_the_table_is_read_and_every_reader_is_total(
        tmp_path: Path, tuned: dict[str, Any]) -> None:
    path = write_table(tmp_path / "tuned.yaml", tuned)
    registry = Registry.build(config=[path], env={})
    mine = [p for p in registry.problems if p.path == str(path)]
    for problem in mine:  # located like every other field: the file, a line of the rule, the key
        assert problem.line is not None and 3 <= problem.line <= len(path.read_text().splitlines()), problem
        assert str(problem.key).startswith("rules[0].tuned"), problem
        assert "Exceeds the limit" not in str(problem) and len(str(problem)) < 600, problem
    pins = tuned["pins"]
    for field, _ in pin_problems(pins):  # each field the one check refuses is named where it is written
        assert any(str(p.key) == f"rules[0].tuned.pins.{field}" for p in mine), (field, mine)
    if not mine:
        assert not pin_problems(pins)
    read_everything(registry)
    # a reader the table check did not guard (the raw mapping straight in): a finding per unreadable field
    found = stale_pins(pins, registry, SHAPE)
    unreadable = {s.field for s in found if str(s.recorded).startswith("an unreadable value")}
    assert unreadable == {f for f, _ in pin_problems(pins)}
    assert all(s.text() for s in found)


@settings(max_examples=60, deadline=None, database=None)
@given(field=st.sampled_from(PIN_KEYS), value=hostile)
def test_one_check_per_pinned_field_decides_for_the_reader_and_the_comparison(field: str, value: Any) -> None:
    """The table reader and ``stale_pins`` ask the same question (``PIN_CHECKS``): a value one refuses is
    never compared by the other, and a value it accepts is compared without an exception."""
    registry = Registry.build(env={}, entry_points=False)
    refused = PIN_CHECKS[field](value)
    found = stale_pins({field: value}, registry, SHAPE)
    if refused:
        [stale] = found
        assert stale.field == field and stale.recorded == f"an unreadable value ({refused})"
    else:
        assert all(not str(s.recorded).startswith("an unreadable value") for s in found), found


def test_the_issue_examples_are_located_and_explain_answers(tmp_path: Path) -> None:
    """``cpu_flags: 5`` (explain stopped with TypeError) and ``cpu_flags: avx2`` (read letter by letter)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    for value, expected in ((5, "got integer 5"), ("avx2", "got string 'avx2' (write it as a list: [avx2])")):
        path = write_table(tmp_path / "t.yaml", {"results": [{"method": "m46", "ok": True, "ms": {1: 1.0}}],
                                                 "pins": {"cpu_flags": value}})
        check = subprocess.run([str(QUANTREG), "validate", str(path)], capture_output=True, text=True, env=env,
                               timeout=120)
        assert check.returncode == 1 and "Traceback" not in check.stderr
        line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if "cpu_flags" in text)
        assert check.stdout.strip() == (f"{path}:{line}: rules[0].tuned.pins.cpu_flags: expected a list of CPU flag "
                                        f"names such as [avx2, fma], {expected}"), check.stdout
        shown = subprocess.run([str(QUANTREG), "explain", *KEY, "--config", str(path)], capture_output=True,
                               text=True, env=env, timeout=120)
        assert shown.returncode == 0 and "internal error" not in shown.stderr, shown.stderr
        assert "LEFT OUT" in shown.stdout or "left out" in shown.stdout, shown.stdout


def test_valid_evidence_reads_as_tune_wrote_it(tmp_path: Path) -> None:
    """The other side of the property: what tune records passes, and is compared field by field."""
    registry = Registry.build(env={})
    pins = running_pins(registry, [], SHAPE)
    path = write_table(tmp_path / "tuned.yaml", {**GOOD_TUNED, "pins": pins,
                                                 "results": [{"method": "m46", "ok": True, "ms": {1: 1.5}}]})
    built = Registry.build(config=[path], env={})
    assert [p for p in built.problems if p.path == str(path)] == []
    rule = built.resolve(KEY).rule
    assert rule is not None and [s.text() for s in built.stale_evidence(rule, SHAPE)] == []
    assert not math.isnan(pins["bandwidth_gbs"])
