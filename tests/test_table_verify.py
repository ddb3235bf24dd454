"""``verify:`` without vLLM: the rule syntax and its located problems, the schema, explain, the schedule."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import yaml
from core_support import run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from quantreg.table.file import Tier, parse_table
from quantreg.table.schema import table_schema
from quantreg.table.verify import (
    DEFAULT_DECODERS,
    DEFAULT_EVERY,
    DEFAULT_FIRST,
    DEFAULT_TOLERANCE,
    VerifySpec,
    layer_index,
)

pytestmark = pytest.mark.usefixtures("clean_env")

VALIDATOR = jsonschema.Draft202012Validator(table_schema())
HEAD = "version: 1\nrules:\n  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss}\n    method: vllm\n"


def problems_of(verify: str, head: str = HEAD) -> list[str]:
    _, problems, _ = parse_table(head + f"    verify: {verify}\n", "t.yaml", Tier.USER)
    return [str(p) for p in problems]


def test_a_full_verify_is_read_with_its_values() -> None:
    table, problems, _ = parse_table(
        HEAD + "    verify: {against: mxfp4_reference, every: 1000, first: 8, tolerance: 0.02, decoders: [3, 1]}\n",
        "t.yaml", Tier.USER)
    assert not problems and table is not None
    rule = table.rules[0]
    assert rule.verify == VerifySpec("mxfp4_reference", every=1000, first=8, tolerance=0.02, decoders=(1, 3))
    assert rule.verify_line == 5


def test_only_against_is_required() -> None:
    table, problems, _ = parse_table(HEAD + "    verify: {against: float64}\n", "t.yaml", Tier.USER)
    assert not problems and table is not None
    assert table.rules[0].verify == VerifySpec("float64", DEFAULT_EVERY, DEFAULT_FIRST, DEFAULT_TOLERANCE,
                                               DEFAULT_DECODERS)


CALLS = "expected a count of forward calls from"


@pytest.mark.parametrize(("verify", "expected"), [
    ("{against: float64, every: 0}", f"t.yaml:5: rules[0].verify.every: {CALLS} 1 to 2,147,483,647, got integer 0"),
    ("{against: float64, every: 1.5}", f"rules[0].verify.every: {CALLS} 1 to 2,147,483,647, got number 1.5"),
    ("{against: float64, every: true}", f"rules[0].verify.every: {CALLS} 1 to 2,147,483,647, got boolean true"),
    ("{against: float64, first: -1}", f"rules[0].verify.first: {CALLS} 0 to 2,147,483,647, got integer -1"),
    ("{against: float64, tolerance: 0}", "rules[0].verify.tolerance: expected a positive number"),
    ("{against: float64, tolerance: x}", "rules[0].verify.tolerance: expected a positive number"),
    ("{against: float64, tolerance: .nan}", "rules[0].verify.tolerance: expected a positive number"),
    ("{against: float64, decoders: 0}", "rules[0].verify.decoders: expected a count from 1 to 1,024"),
    ("{against: float64, decoders: []}", "rules[0].verify.decoders: expected a count from 1 to 1,024"),
    ("{against: float64, decoders: [1, 1]}", "distinct layer indices"),
    ("{against: float64, decoders: [-1]}", "distinct layer indices from 0 to 1,023, got list integer -1"),
    ("{every: 3}", "t.yaml:5: rules[0].verify.against: missing; expected a registered method name or 'float64'"),
    ("{against: 3}", "rules[0].verify.against: expected a method name or 'float64', got integer 3"),
    ("{against: vllm}", "rules[0].verify.against: cannot verify against 'vllm'"),
    ("{against: float64, evrey: 3}", "rules[0].verify.evrey: unknown key; did you mean 'every'?"),
    ("float64", "rules[0].verify: expected a mapping with 'against'"),
])
def test_bad_values_are_located_problems(verify: str, expected: str) -> None:
    problems = problems_of(verify)
    assert len(problems) == 1 and expected in problems[0], problems


def test_a_multi_line_verify_names_the_line_of_the_bad_value() -> None:
    problems = problems_of("\n      against: float64\n      every: 10\n      decoders: nope")
    assert problems == ["t.yaml:8: rules[0].verify.decoders: expected a count from 1 to 1,024 (the first N MoE layers) "
                        "or a non-empty list of distinct layer indices from 0 to 1,023, got string 'nope'"]


@pytest.mark.parametrize("quant_format", ["'*'", "fp8", "[gpt_oss_mxfp4, fp8]"])
def test_float64_needs_a_format_with_a_float64_reference(quant_format: str) -> None:
    head = f"version: 1\nrules:\n  - match: {{quant_format: {quant_format}}}\n    method: vllm\n"
    problems = problems_of("{against: float64}", head)
    assert len(problems) == 1 and "'float64' needs a quant format with a float64 reference (gpt_oss_mxfp4)" \
        in problems[0], problems
    doc = yaml.safe_load(head + "    verify: {against: float64}\n")
    assert not VALIDATOR.is_valid(doc)  # the schema says the same


def test_a_broken_match_is_not_also_a_float64_problem() -> None:
    head = "version: 1\nrules:\n  - match: {quant_format: 3}\n    method: vllm\n"
    problems = problems_of("{against: float64}", head)
    assert len(problems) == 1 and "rules[0].match.quant_format" in problems[0]


# -- the schema and the loader agree ------------------------------------------------------------
# no integral floats (2.0): JSON Schema counts them as integers, the loader wants an integer literal
# (the known difference test_table_schema.py documents for priority)
values = st.one_of(st.none(), st.booleans(), st.integers(-2, 3),
                   st.sampled_from([0.02, -0.5, 1.5, "x", [], [1], [0, 2], [1, 1], [-1], ["a"], [True]]))
verifies = st.one_of(
    values,
    st.fixed_dictionaries({}, optional={"against": st.sampled_from(["float64", "mxfp4_reference", "vllm", "a b", 1]),
                                        "every": values, "first": values, "tolerance": values, "layers": values,
                                        "evrey": values}),
)
formats = st.one_of(st.just("*"), st.sampled_from(["gpt_oss_mxfp4", "fp8"]),
                    st.lists(st.sampled_from(["gpt_oss_mxfp4", "fp8"]), min_size=1, max_size=2, unique=True))
matches = st.one_of(st.none(), st.just({}), st.fixed_dictionaries({"quant_format": formats}))


@settings(max_examples=400, deadline=None, database=None)
@given(matches, verifies)
def test_schema_and_loader_agree_on_verify(match: object, verify: object) -> None:
    text = yaml.safe_dump({"version": 1, "rules": [{"match": match, "method": "vllm", "verify": verify}]})
    _, problems, _ = parse_table(text, "random.yaml", Tier.USER)
    assert VALIDATOR.is_valid(yaml.safe_load(text)) == (not problems), (text, problems)


# -- the schedule --------------------------------------------------------------------------------
def verified_calls(spec: VerifySpec, calls: int) -> list[int]:
    """Walk the schedule the way the verifying method does: one counter, one "next" number."""
    out, nxt = [], spec.next_call(0)
    for n in range(1, calls + 1):
        if n == nxt:
            out.append(n)
            nxt = spec.next_call(n)
    return out


@pytest.mark.parametrize(("first", "every", "expected"), [
    (3, 4, [1, 2, 3, 7, 11, 15, 19]),
    (0, 5, [5, 10, 15, 20]),
    (2, 1, list(range(1, 21))),
    (0, 10**9, []),  # the benchmark's setting: nothing sampled
    (25, 1000, list(range(1, 21))),
])
def test_first_calls_then_one_in_every(first: int, every: int, expected: list[int]) -> None:
    assert verified_calls(VerifySpec("float64", every=every, first=first), 20) == expected


@given(st.integers(0, 20), st.integers(1, 20), st.integers(0, 200))
def test_next_call_is_the_first_verified_call_after_n(first: int, every: int, n: int) -> None:
    spec = VerifySpec("float64", every=every, first=first)

    def verified(c: int) -> bool:
        return c <= first or (c - first) % every == 0

    nxt = spec.next_call(n)
    assert nxt > n and verified(nxt) and not any(verified(c) for c in range(n + 1, nxt))


@pytest.mark.parametrize(("prefix", "index"), [
    ("model.layers.3.mlp.experts", 3), ("model.layers.12.mlp.experts.routed_experts", 12),
    ("layers.0.mlp.experts", 0), ("model.mlp.experts", None), ("model.sublayers.2.mlp", None),
])
def test_layer_index_from_the_prefix(prefix: str, index: int | None) -> None:
    assert layer_index(prefix) == index


def test_layers_count_or_list() -> None:
    assert [VerifySpec("x", decoders=2).covers(i, {0, 1, 2}) for i in (0, 1, 2, None)] == [True, True, False, False]
    # the first 2 MoE layers of a model whose layers 0-2 are dense: 3 and 4
    assert [VerifySpec("x", decoders=2).covers(i, range(3, i + 1)) for i in (3, 4, 5)] == [True, True, False]
    assert [VerifySpec("x", decoders=(1, 5)).covers(i) for i in (0, 1, 5)] == [False, True, True]


# -- validate and explain through the real CLI -------------------------------------------------------
def test_validate_locates_an_unknown_against_method(table: Callable[[str, str], Path]) -> None:
    path = table("t.yaml", HEAD + "    verify: {against: vlm_reference, first: 2}\n")
    out = run_cli("validate", "--config", str(path))
    assert out.returncode == 1 and "Traceback" not in out.stderr + out.stdout
    assert (f"{path}:5: rules[0].verify.against: unknown method 'vlm_reference'" in out.stdout + out.stderr), \
        out.stdout + out.stderr


def test_explain_shows_the_verify_plan(table: Callable[[str, str], Path]) -> None:
    verify = "    verify: {against: float64, every: 500, first: 4, tolerance: 0.01, decoders: [0, 2]}\n"
    path = table("t.yaml", HEAD + verify)
    out = run_cli("explain", "gpt_oss_mxfp4", "gpt_oss", "cpu", "--config", str(path))
    assert out.returncode == 0, out.stderr
    assert "verify " not in out.stdout  # the rule chose vLLM's own method: nothing to verify
    chosen = table("c.yaml", HEAD.replace("method: vllm", "method: e2e_x") + verify
                   + "methods:\n  e2e_x: {target: 'json:JSONDecoder'}\nallow_import_targets: true\n")
    out = run_cli("explain", "gpt_oss_mxfp4", "gpt_oss", "cpu", "--config", str(chosen))
    assert out.returncode == 0, out.stderr
    assert ("verify   e2e_x against float64 on MoE layers 0, 2: the first 4 forward calls, then 1 in 500; "
            "tolerance 0.01 on max|out-ref|/max|ref|") in out.stdout, out.stdout
    data = json.loads(run_cli("explain", "gpt_oss_mxfp4", "gpt_oss", "cpu", "--config", str(chosen), "--json").stdout)
    assert data["rule"]["verify"] == {"against": "float64", "every": 500, "first": 4, "tolerance": 0.01,
                                      "decoders": [0, 2]}
