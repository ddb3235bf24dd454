"""Keys, match patterns and the index: specificity, overlap, per-pattern lookup, ambiguity.

Also here (issue 24 class 5): no cross products, the index against brute force, from
test_containment_loader.py (issue 12, loader classes) (class 4).
"""

from __future__ import annotations

from itertools import product
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantreg import Registry
from quantreg.index import Index
from quantreg.keys import Key, Match
from quantreg.methods import Method
from quantreg.plugins import Plugins
from quantreg.table.file import Rule, TableFile, Tier

pytestmark = pytest.mark.usefixtures("clean_env")


def rule(match: Match, line: int, tier: Tier = Tier.USER, priority: int = 0, path: str = "t.yaml") -> Rule:
    return Rule(match=match, methods=("vllm",), path=path, line=line, tier=tier, priority=priority)


def test_key_is_three_plain_strings() -> None:
    key = Key("gpt_oss_mxfp4", "gpt_oss", "hpu")
    assert key == ("gpt_oss_mxfp4", "gpt_oss", "hpu")
    assert key.device == "hpu"
    assert str(key) == "(gpt_oss_mxfp4, gpt_oss, hpu)"
    assert {key: 1}[Key(*("gpt_oss_mxfp4", "gpt_oss", "hpu"))] == 1


def test_match_specificity_pattern_and_str() -> None:
    m = Match(quant_format=("fp8",), device=("cpu", "hpu"))
    assert m.specificity == 2
    assert m.pattern == (True, False, True)
    assert str(m) == "(fp8, *, [cpu|hpu])"
    assert Match().specificity == 0
    assert str(Match()) == "(*, *, *)"


def test_match_matches_wildcards_and_lists() -> None:
    m = Match(quant_format=("fp8",), device=("cpu", "hpu"))
    assert m.matches(Key("fp8", "anything", "cpu"))
    assert m.matches(Key("fp8", "llama", "hpu"))
    assert not m.matches(Key("fp8", "llama", "cuda"))
    assert not m.matches(Key("mxfp4", "llama", "cpu"))
    assert Match().matches(Key("a", "b", "c"))


def test_match_overlaps() -> None:
    a = Match(quant_format=("x",))
    b = Match(model_type=("y",))
    assert a.overlaps(b) and b.overlaps(a)  # key (x, y, *) matches both
    assert Match(device=("cpu", "hpu")).overlaps(Match(device=("hpu", "xpu")))
    assert not Match(device=("cpu",)).overlaps(Match(device=("hpu",)))
    assert Match().overlaps(Match(device=("cpu",)))


def test_match_expand_enumerates_fixed_fields() -> None:
    m = Match(quant_format=("a", "b"), device=("c",))
    assert sorted(m.expand((True, False, True))) == [("a", "c"), ("b", "c")]
    assert list(m.expand((False, False, False))) == [()]


def test_candidates_are_exactly_the_matching_rules_best_first() -> None:
    rules = [
        rule(Match(), 1, Tier.DEFAULT),
        rule(Match(device=("hpu",)), 2),
        rule(Match(quant_format=("fp8",), device=("hpu",)), 3),
        rule(Match(quant_format=("fp8",)), 4, priority=5),
        rule(Match(device=("cpu",)), 5, Tier.RUN),  # does not match
        rule(Match(model_type=("llama", "gpt_oss")), 6, Tier.PLUGIN),
    ]
    index = Index(rules)
    found = index.candidates(Key("fp8", "gpt_oss", "hpu"))
    # user tier first: specificity 2, then specificity 1 with priority 5, then priority 0; then plugin, default
    assert [r.line for r in found] == [3, 4, 2, 6, 1]
    assert index.candidates(Key("int8", "qwen", "xpu")) == [rules[0]]


def test_equal_rank_keeps_file_order() -> None:
    a = rule(Match(device=("cpu",)), 1)
    b = rule(Match(device=("hpu",)), 2)
    c = rule(Match(quant_format=("q",)), 3)
    index = Index([a, b, c])
    assert index.candidates(Key("q", "m", "cpu")) == [a, c]


def test_rule_with_a_list_is_found_once_per_key() -> None:
    r = rule(Match(device=("cpu", "hpu"), model_type=("a", "b")), 1)
    index = Index([r])
    for k in product(("q",), ("a", "b"), ("cpu", "hpu")):
        assert index.candidates(Key(*k)) == [r]
    assert index.candidates(Key("q", "c", "cpu")) == []


class CountingRule(Rule):
    """A rule counting how often the index looks at its precedence (once per considered rule)."""

    seen = 0

    @property
    def rank(self) -> tuple[int, int, int]:
        CountingRule.seen += 1
        return super().rank


def test_lookup_touches_only_matching_rules() -> None:
    rules = [
        CountingRule(match=Match(quant_format=(f"q{i % 100}",), model_type=(f"m{i // 100}",), device=("cpu",)),
                     methods=("vllm",), path="big.yaml", line=i + 1, tier=Tier.USER)
        for i in range(10_000)
    ]
    rules.append(CountingRule(match=Match(device=("cpu",)), methods=("vllm",), path="big.yaml", line=10_001,
                              tier=Tier.USER))
    index = Index(rules)
    CountingRule.seen = 0
    found = index.candidates(Key("q7", "m42", "cpu"))
    assert [r.line for r in found] == [4208, 10_001]
    assert CountingRule.seen == len(found)  # the other 9,999 rules were never considered
    CountingRule.seen = 0
    assert index.candidates(Key("q7", "m42", "hpu")) == []
    assert CountingRule.seen == 0


def test_resolve_on_a_ten_thousand_rule_table_touches_only_matching_rules() -> None:
    rules = [
        CountingRule(match=Match(quant_format=(f"q{i % 100}",), model_type=(f"m{i // 100}",), device=("cpu",)),
                     methods=("vllm",), path="big.yaml", line=i + 1, tier=Tier.USER)
        for i in range(10_000)
    ]
    registry = Registry(Plugins(env={}, entry_points=False), {"vllm": Method("vllm", "quantreg.builtin:KeepVllm")},
                        [TableFile("big.yaml", Tier.USER, tuple(rules))], [])
    CountingRule.seen = 0
    decision = registry.resolve(Key("q3", "m17", "cpu"))
    assert decision.rule is rules[1703]
    assert [c.rule for c in decision.candidates] == [rules[1703]]
    assert CountingRule.seen <= 3  # a handful of looks at the one matching rule, none at the other 9,999


def test_large_yaml_table_resolves_through_the_index(tmp_path: Path) -> None:
    n = 1_000  # parsing YAML is the slow part; the index is exercised at 10,000 rules above
    lines = ["version: 1", "rules:"]
    for i in range(n):
        lines.append(f"  - {{match: {{quant_format: q{i % 100}, model_type: m{i // 100}, device: cpu}}, method: vllm}}")
    lines.append("  - {match: {device: cpu}, method: vllm, note: catch-all for cpu}")
    path = tmp_path / "big.yaml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    registry = Registry.build(config=[path], env={}, entry_points=False)
    assert registry.problems == ()
    assert len(registry.index.rules) == n + 2  # + the default table's rule
    key = Key("q7", "m4", "cpu")
    decision = registry.resolve(key)
    expected = [r for r in registry.index.rules if r.match.matches(key)]
    assert [c.rule for c in decision.candidates] == registry.index.candidates(key)
    assert sorted(c.rule.location for c in decision.candidates) == sorted(r.location for r in expected)
    assert len(decision.candidates) == 3  # the specific rule, the cpu catch-all, the default table
    assert decision.rule is not None and decision.rule.location == f"{path}:{407 + 3}"


def test_ambiguity_names_both_rules() -> None:
    a = rule(Match(device=("hpu",)), 3, path="one.yaml")
    b = rule(Match(quant_format=("fp8",)), 7, path="two.yaml")
    problems = Index([a, b]).ambiguities()
    assert len(problems) == 1
    p = problems[0]
    assert (p.path, p.line, p.key) == ("two.yaml", 7, "match")
    assert "one.yaml:3" in p.message and "ambiguous" in p.message
    assert "two.yaml:7" in str(p)


@pytest.mark.parametrize(
    ("first", "second", "ambiguous"),
    [
        (Match(device=("cpu", "hpu")), Match(device=("hpu", "xpu")), True),
        (Match(device=("cpu",)), Match(device=("hpu",)), False),
        (Match(quant_format=("a",), device=("cpu",)), Match(quant_format=("a",), device=("hpu",)), False),
        (Match(quant_format=("a",), device=("cpu",)), Match(model_type=("m",), device=("cpu",)), True),
        (Match(quant_format=("a",)), Match(model_type=("m",)), True),
        (Match(), Match(), True),
        (Match(), Match(device=("cpu",)), False),  # different specificity
    ],
)
def test_ambiguity_exactly_when_equal_rank_rules_overlap(first: Match, second: Match, ambiguous: bool) -> None:
    problems = Index([rule(first, 1), rule(second, 2)]).ambiguities()
    assert bool(problems) == ambiguous
    assert first.overlaps(second) or not ambiguous


def test_no_ambiguity_across_layers_or_priorities() -> None:
    assert Index([rule(Match(), 1, Tier.USER), rule(Match(), 2, Tier.RUN)]).ambiguities() == []
    assert Index([rule(Match(), 1), rule(Match(), 2, priority=1)]).ambiguities() == []


def test_each_ambiguous_pair_is_reported_once() -> None:
    rules = [rule(Match(device=("cpu", "hpu")), i) for i in (1, 2, 3)]
    problems = Index(rules).ambiguities()
    assert sorted((p.line, p.message.split("rule t.yaml:")[1][:1]) for p in problems) == [
        (2, "1"), (3, "1"), (3, "2")]


# -- from test_containment_loader.py (issue 12, loader classes) -------------------------------


def _rule(match: dict[str, Any], line: int = 1, priority: int = 0) -> Any:
    from quantreg.keys import Match
    from quantreg.table.file import Rule

    fields = {k: (None if v == "*" else tuple(sorted(set(v)))) for k, v in match.items()}
    return Rule(match=Match(**fields), methods=("vllm",), path="t.yaml", line=line, tier=Tier.USER,
                priority=priority, where=f"rules[{line}]")


def test_a_220_value_rule_is_indexed_without_its_cross_product() -> None:
    from quantreg.index import Index
    from quantreg.keys import Key

    values = [f"v{i}" for i in range(220)]
    index = Index([_rule({"quant_format": values, "model_type": values, "device": values})])
    assert sum(len(t) for t in index._by_pattern.values()) == 0  # nothing expanded
    assert sum(len(v) for by in index._wide.values() for v in by.values()) == 220  # one posting per value
    assert [r.line for r in index.candidates(Key("v3", "v219", "v100"))] == [1]
    assert index.candidates(Key("v3", "v219", "nope")) == []
    assert index.ambiguous_pairs() == []


match_field = st.one_of(st.just("*"), st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=8))


rule_rows = st.lists(st.tuples(st.fixed_dictionaries({"quant_format": match_field, "model_type": match_field,
                                                      "device": match_field}), st.integers(0, 1)), max_size=8)


@settings(max_examples=300, deadline=None, database=None)
@given(rule_rows)
def test_index_and_ambiguities_equal_brute_force_with_wide_and_narrow_rules(rows: list[Any]) -> None:
    from itertools import combinations

    from quantreg.index import MAX_AMBIGUITIES, Index
    from quantreg.keys import Key

    rules = [_rule(m, line=i + 1, priority=p) for i, (m, p) in enumerate(rows)]
    index = Index(rules)
    for key in [Key(q, m, d) for q in "abz" for m in "chz" for d in "ahz"]:
        expected = sorted((r for r in rules if r.match.matches(key)), key=lambda r: (tuple(-x for x in r.rank), r.line))
        assert index.candidates(key) == expected
    brute = {(a.line, b.line) for a, b in combinations(rules, 2) if a.rank == b.rank and a.match.overlaps(b.match)}
    found = {(a.line, b.line) for a, b in index.ambiguous_pairs()}
    assert found == brute if len(brute) < MAX_AMBIGUITIES else len(found) == MAX_AMBIGUITIES
