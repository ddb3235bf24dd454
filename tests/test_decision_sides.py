"""One decision value with all its sides, read by every consumer (issue 46, class 4).

A key split by ``tokens:`` rules is one :class:`quantreg.decision.Decision` whose top-level fields are the
first side's; readers that knew only those fields treated the other sides as second-class: ``doctor
--decisions`` compared only the first side (two processes differing on ``tokens>32`` read "all processes
agree"), the strict verdict of ``explain`` predicted a clean start where the seam refused a second side with
no runnable method, a side's ``verify:`` was dropped when both sides shared a method, and ``doctor`` listed
passed-over chains of the first side only.

The property draws tables of ranged and unranged rules for one key, with chains mixing methods that run
here and one that does not (devices: hpu) and ``verify:`` on some rules, and walks every consumer with the
resulting decision: the trail summary, the strict verdict (the envelope every command answers with, and
the seam's ``Decision.unrunnable``), the verify plan (what the seam builds per side), doctor's passed-over
chains and ``plan``'s answer. Each must read every side.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import quantreg
from quantreg import doctor
from quantreg.audit import line_for, summarise
from quantreg.envelope import refusal
from quantreg.keys import Key
from quantreg.methods import Method
from quantreg.plan import Checkpoint, device_plan
from quantreg.registry import Registry

pytestmark = pytest.mark.usefixtures("clean_env")

KEY = Key("fp8", "mixtral", "cpu")
"""A key vLLM's own method serves on every host kind (a gap between ranges falls to it, runnable)."""
HERE = ("ok_a", "ok_b")
GONE = "gone"  # registered for hpu only: passed over on this cpu key


class Methods:
    """Registers the methods the decisions name (targets never imported: nothing is built)."""

    @quantreg.hookimpl
    def register_methods(self, register: Callable[[Method], None]) -> None:
        for name in HERE:
            register(Method(name, f"sides_methods:{name.title()}", expert_layout="checkpoint"))
        register(Method(GONE, "sides_methods:Gone", devices=("hpu",), expert_layout="checkpoint"))


ranged_rule = st.fixed_dictionaries({
    "tokens": st.sampled_from(["<=8", ">8", "<=32", ">32", ">=64", "<16"]),
    "method": st.lists(st.sampled_from([*HERE, GONE]), min_size=1, max_size=2, unique=True),
    "verify": st.none() | st.sampled_from(HERE),
})
base_rule = st.none() | st.fixed_dictionaries({
    "method": st.lists(st.sampled_from([*HERE, GONE]), min_size=1, max_size=2, unique=True),
    "verify": st.none() | st.sampled_from(HERE),
})


def write(path: Path, ranged: list[dict[str, Any]], base: dict[str, Any] | None) -> Path:
    rules = []
    for priority, item in enumerate([*([base] if base else []), *ranged]):
        match = {"quant_format": KEY[0], "model_type": KEY[1], "device": KEY[2]}
        if "tokens" in item:
            match["tokens"] = item["tokens"]
        rule: dict[str, Any] = {"match": match, "method": item["method"], "priority": priority}
        if item["verify"]:
            rule["verify"] = {"against": item["verify"], "first": 2}
        rules.append(rule)
    path.write_text(yaml.safe_dump({"version": 1, "rules": rules}, sort_keys=False))
    return path


def runnable(registry: Registry, rule: Any) -> bool:
    """Brute force, per side: can any method of the side's winning rule run here?"""
    return rule is None or any(registry.availability_for(m, KEY).ok for m in rule.methods)


@settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ranged=st.lists(ranged_rule, min_size=1, max_size=3), base=base_rule)
def test_every_consumer_reads_every_side(tmp_path: Path, ranged: list[dict[str, Any]],
                                         base: dict[str, Any] | None) -> None:
    path = write(tmp_path / "split.yaml", ranged, base)
    registry = Registry.build(config=[path], env={"QUANTREG_STRICT": "1"}, entry_points=False,
                              plugins=[("sides", Methods())])
    assume(not registry.problems)  # (verify: against the chosen method itself, ambiguity: other tests' business)
    decision = registry.resolve(KEY)
    sides = decision.sides

    # the strict verdict: every side whose chain cannot run here refuses, as the seam does
    expected_refusal = any(not runnable(registry, s.decision.rule) for s in sides)
    assert bool(decision.unrunnable) == expected_refusal
    verdict = refusal(registry, decision)
    assert (verdict is not None) == expected_refusal, (verdict, decision.summary())
    if decision.unrunnable:  # the first side that cannot run is named with its range (the others counted)
        side = decision.unrunnable[0]
        assert verdict is not None and (f"for tokens{side.tokens} [" in verdict or not decision.split), verdict

    # the verify plan: a side's verify: is what runs on its forwards, never another side's (or none)
    for side in sides:
        applied = side.decision.verify if decision.is_split else decision.verify
        assert applied == side.decision.verify, (str(side.tokens), decision.render())

    # the trail: two processes differing on any one side disagree; the same decision agrees
    line = json.loads(line_for(decision, role="EngineCore", layer_count=1, strict=True, fingerprint="f"))
    trail = tmp_path / "trail.jsonl"
    trail.write_text(json.dumps({**line, "pid": 1}) + "\n" + json.dumps({**line, "pid": 2}) + "\n")
    assert summarise(trail).disagreements == []
    for k in range(len(decision.split)):
        other = json.loads(json.dumps(line))
        other["split"][k]["method"] = "somewhere_else"
        trail.write_text(json.dumps({**line, "pid": 1}) + "\n" + json.dumps({**other, "pid": 2}) + "\n")
        found = summarise(trail)
        assert len(found.disagreements) == 1 and "chose different methods" in found.disagreements[0], found
        assert "somewhere_else for tokens" in found.render()

    # doctor: the passed-over chain of every side, named by its range
    listed = {(e.get("tokens"), e["method"]) for e in doctor._passed_over(registry)}
    for side in sides:
        if side.decision.passed_over:
            assert ((str(side.tokens) if decision.split else None), side.decision.method) in listed, listed

    # plan: every side with its method, the one spelling of the methods
    ck = Checkpoint(str(tmp_path), model_type="mixtral", moe_layers=[0, 1],
                    experts={"count": 4, "hidden_size": 64, "intermediate_size": 64, "per_token": 2})
    planned = device_plan(registry, ck, KEY)
    assert planned["method"] == decision.methods_text()
    if decision.split:
        assert [(s["tokens"], s["method"]) for s in planned["split"]] == [
            (str(s.tokens), s.decision.method) for s in decision.split]


def test_a_split_whose_second_side_cannot_run_is_refused_by_explain_as_by_the_seam(tmp_path: Path) -> None:
    """The issue's example: strict explain predicted a clean start for it."""
    path = write(tmp_path / "t.yaml", [{"tokens": "<=32", "method": ["ok_a"], "verify": None},
                                       {"tokens": ">32", "method": [GONE], "verify": None}], None)
    registry = Registry.build(config=[path], env={"QUANTREG_STRICT": "1"}, entry_points=False,
                              plugins=[("sides", Methods())])
    decision = registry.resolve(KEY)
    assert decision.method == "ok_a" and decision.fallback is None  # the first side is fine
    verdict = refusal(registry, decision)
    assert verdict is not None and f"-> vllm for tokens>32 [{path}:" in verdict, verdict
    assert "(fallback for tokens>32: no method in the chain is available here" in decision.summary()


def test_a_verify_on_the_second_side_of_one_method_is_kept(tmp_path: Path) -> None:
    """Both sides choose ok_a; only the second verifies: two method objects, the second verified."""
    path = write(tmp_path / "t.yaml", [{"tokens": "<=32", "method": ["ok_a"], "verify": None},
                                       {"tokens": ">32", "method": ["ok_a"], "verify": "ok_b"}], None)
    registry = Registry.build(config=[path], env={}, entry_points=False, plugins=[("sides", Methods())])
    decision = registry.resolve(KEY)
    assert decision.is_split and decision.split[1].decision.verify is not None
    assert "one method object per layer holds every side" in decision.render()
