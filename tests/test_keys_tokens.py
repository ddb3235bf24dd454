"""The ``tokens`` match key (issue 32): parsing, precedence, gaps, ambiguity, split decisions, JSON, explain.

Rules that differ by their token range partition a key: each forward token count is decided among
the rules that cover it by the usual precedence (a written range counts one in specificity), a
count no ranged rule covers falls to the next rule by precedence (gaps are allowed and filled that
way), and two rules of equal rank whose ranges overlap are ambiguous (a load-time error).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from core_support import run_cli

import quantreg
from quantreg.audit import line_for
from quantreg.keys import Key, Match, TokenRange
from quantreg.methods import Method
from quantreg.registry import Registry, token_sides
from quantreg.table.file import Tier, parse_table, rule_json
from quantreg.table.schema import table_schema

pytestmark = pytest.mark.usefixtures("clean_env")

KEY = Key("gpt_oss_mxfp4", "gpt_oss", "cpu")
M = "quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu"


class Methods:
    """Registers method names for the decisions (their targets are never imported: nothing is built)."""

    def __init__(self, *names: str) -> None:
        self.names = names

    @quantreg.hookimpl
    def register_methods(self, register: Callable[[Method], None]) -> None:
        for name in self.names:
            register(Method(name, f"tokens_methods:{name.title().replace('_', '')}"))


def registry(tmp_path: Path, text: str, name: str = "t.yaml") -> Registry:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return Registry.build(config=[path], entry_points=False, plugins=[("t", Methods("small", "large", "base"))])


def rules(*items: tuple[str | None, str]) -> str:
    out = ["version: 1", "rules:"]
    for tokens, method in items:
        extra = f', tokens: "{tokens}"' if tokens is not None else ""
        out += [f"  - match: {{{M}{extra}}}", f"    method: {method}"]
    return "\n".join(out) + "\n"


@pytest.mark.parametrize(("text", "low", "high", "shown"), [
    ("<=64", 1, 64, "<=64"), ("<64", 1, 63, "<=63"), (">64", 65, None, ">64"), (">=64", 64, None, ">63"),
    (" <= 1 ", 1, 1, "<=1"), (">=1", 1, None, ">=1"), ("<2", 1, 1, "<=1")])
def test_the_four_forms_and_their_written_form(text: str, low: int, high: int | None, shown: str) -> None:
    found = TokenRange.parse(text)
    assert (found.low, found.high, str(found)) == (low, high, shown)
    assert TokenRange.parse(str(found)) == found  # the shown form reads back as the same range
    assert found.covers(low) and not found.covers(low - 1) and (high is None or not found.covers(high + 1))


@pytest.mark.parametrize("text", ["64", "=<64", "<=0", ">0", "<1", "<= -3", "<=6.5", "tokens<=8", "<=8 or more", ""])
def test_anything_else_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        TokenRange.parse(text)


def test_a_range_counts_one_in_specificity_and_disjoint_ranges_do_not_overlap() -> None:
    table, problems, _ = parse_table(rules(("<=8", "small"), (">8", "large"), (None, "base")), "t.yaml", Tier.USER)
    assert table is not None and not problems
    small, large, base = table.rules
    assert (small.match.specificity, base.match.specificity) == (4, 3)
    assert not small.match.overlaps(large.match) and small.match.overlaps(base.match)
    assert str(small.match) == "(gpt_oss_mxfp4, gpt_oss, cpu, tokens<=8)"
    assert rule_json(small)["match"]["tokens"] == "<=8" and "tokens" not in rule_json(base)["match"]
    assert small.match == Match(("gpt_oss_mxfp4",), ("gpt_oss",), ("cpu",), tokens=TokenRange(1, 8))


def test_two_ranges_split_the_key(tmp_path: Path) -> None:
    reg = registry(tmp_path, rules(("<=8", "small"), (">8", "large")))
    assert not reg.faults
    d = reg.resolve(KEY)
    assert [(str(s.tokens), s.decision.method) for s in d.split] == [("<=8", "small"), (">8", "large")]
    assert d.is_split and d.method == "small"  # the top level reads as the first side (decode)
    where = tmp_path / "t.yaml"
    assert d.head() == f"{KEY} -> small for tokens<=8 [{where}:3], large for tokens>8 [{where}:5]"
    data = d.to_json()
    assert [(s["tokens"], s["low"], s["high"], s["method"]) for s in data["split"]] == [
        ("<=8", 1, 8, "small"), (">8", 9, None, "large")]
    assert json.loads(line_for(d, role="t", layer_count=2, strict=False, fingerprint="f"))["split"] == [
        {"tokens": "<=8", "method": "small", "rule": f"{tmp_path / 't.yaml'}:3", "fallback": None},
        {"tokens": ">8", "method": "large", "rule": f"{tmp_path / 't.yaml'}:5", "fallback": None}]
    # each side names the other's rule as a loser outside its range
    reasons = [c.reason for c in d.split[0].decision.candidates if not c.won]
    assert any("its range tokens>8 does not cover tokens<=8" in r for r in reasons)


def test_a_gap_falls_to_the_next_rule_by_precedence(tmp_path: Path) -> None:
    reg = registry(tmp_path, rules(("<=8", "small"), (">64", "large"), (None, "base")))
    assert not reg.faults
    d = reg.resolve(KEY)
    assert [(str(s.tokens), s.decision.method) for s in d.split] == [
        ("<=8", "small"), ("9..64", "base"), (">64", "large")]
    # with no rule of its own for the gap, the table below decides it (the default table: vLLM's own)
    alone = registry(tmp_path, rules(("<=8", "small"), (">64", "large")), "alone.yaml").resolve(KEY)
    assert [(str(s.tokens), s.decision.method) for s in alone.split] == [
        ("<=8", "small"), ("9..64", "vllm"), (">64", "large")]


def test_one_ranged_rule_overlays_the_rest(tmp_path: Path) -> None:
    d = registry(tmp_path, rules(("<=4", "small"), (None, "base"))).resolve(KEY)
    assert [(str(s.tokens), s.decision.method) for s in d.split] == [("<=4", "small"), (">4", "base")]


def test_a_higher_layer_rule_without_a_range_wins_every_count(tmp_path: Path) -> None:
    low = tmp_path / "low.yaml"
    low.write_text(rules(("<=8", "small"), (">8", "large")))
    high = tmp_path / "high.yaml"
    high.write_text(rules((None, "base")))
    reg = Registry.build(config=[low], entry_points=False, plugins=[("t", Methods("small", "large", "base"))],
                         env={"QUANTREG_CONFIG": str(high)})
    d = Registry.build(config=[high], entry_points=False, plugins=[("t", Methods("small", "large", "base"))],
                       env={"QUANTREG_CONFIG": str(low)}).resolve(KEY)
    assert not d.split and d.method == "base"  # run tier (high) beats the user tier's ranges everywhere
    assert reg.resolve(KEY).split  # and the other way round the ranges decide
    assert {f"{low}:3", f"{low}:5"} <= {c.rule.location for c in d.candidates if not c.won}


def test_sides_with_the_same_method_and_options_need_no_dispatch(tmp_path: Path) -> None:
    d = registry(tmp_path, rules(("<=8", "base"), (">8", "base"))).resolve(KEY)
    assert len(d.split) == 2 and not d.is_split


def test_overlapping_ranges_of_equal_rank_are_ambiguous(tmp_path: Path) -> None:
    reg = registry(tmp_path, rules(("<=8", "small"), (">=8", "large")))
    assert any("can both match the same key and token count" in str(p) for p in reg.faults), reg.faults
    fine = registry(tmp_path, rules(("<=8", "small"), (">8", "large")), "fine.yaml")
    assert not fine.faults


def test_the_fingerprint_covers_the_ranges(tmp_path: Path) -> None:
    a = registry(tmp_path, rules(("<=8", "small"), (">8", "large")), "a.yaml").fingerprint()
    b = registry(tmp_path, rules(("<=16", "small"), (">16", "large")), "b.yaml").fingerprint()
    c = registry(tmp_path, rules(("<=8", "small"), (">8", "large")), "c.yaml").fingerprint()
    assert a != b and a == c  # content, not the file's name


def test_token_sides_merges_neighbours_with_one_winner(tmp_path: Path) -> None:
    table, _, _ = parse_table(rules(("<=8", "small"), (">8", "large"), (None, "base")), "t.yaml", Tier.USER)
    assert table is not None
    small, large, base = table.rules
    sides = token_sides([small, large, base])
    assert [(str(r), [x.methods[0] for x in cover]) for r, cover, _ in sides] == [
        ("<=8", ["small", "base"]), (">8", ["large", "base"])]
    assert [(str(r), [x.methods[0] for x in cover]) for r, cover, _ in token_sides([base, small])] == [
        (">=1", ["base"])]  # a better rule without a range wins everywhere: one side


def test_the_schema_accepts_what_the_loader_accepts() -> None:
    import jsonschema
    import yaml

    validator = jsonschema.Draft202012Validator(table_schema())
    for text in ["<=64", "<64", ">64", ">=64", " <= 8 ", "<2"]:
        doc = rules((text, "vllm"))
        assert parse_table(doc, "t.yaml", Tier.USER)[0] is not None
        validator.validate(yaml.safe_load(doc))
    for text in ["64", "<=0", "<1", ">0", "=<8"]:
        doc = rules((text, "vllm"))
        assert parse_table(doc, "t.yaml", Tier.USER)[0] is None
        assert not validator.is_valid(yaml.safe_load(doc)), text


@pytest.mark.needs("torch", "vllm")  # both sides' methods must be available for explain to name them
def test_explain_shows_both_sides(tmp_path: Path) -> None:
    from quantreg.host import simulate

    path = tmp_path / "split.yaml"
    path.write_text(rules(("<=8", "mxfp4_reference"), (">8", "vllm")))
    env = {"QUANTREG_CONFIG": str(path), **simulate("amx")}  # vLLM's CPU MXFP4 method runs (AMX) on every host kind
    out = run_cli("explain", "gpt_oss_mxfp4", "gpt_oss", "cpu", env=env)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "method   mxfp4_reference for tokens<=8, vllm for tokens>8" in text
    assert "-- tokens<=8 (forwards of at most 8 tokens)" in text
    assert "-- tokens>8 (forwards of 9 tokens or more)" in text
    js = run_cli("explain", "--json", "gpt_oss_mxfp4", "gpt_oss", "cpu", env=env)
    data = json.loads(js.stdout)
    found = json.dumps(data)
    assert '"split"' in found and '"tokens": "<=8"' in found and '"tokens": ">8"' in found
