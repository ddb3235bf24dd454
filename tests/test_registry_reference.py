"""Resolution against a brute-force reading of the documented precedence on random tables (doubles as
the fuzz test), the ambiguity report limit, and (issue 24 class 5, from test_hardening.py) the
determinism property over validating tables."""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import combinations, product
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from registry_support import LAYER_METHODS, anywhere, build, rules_yaml

from quantreg import Key, Method, Registry, Tier
from quantreg.index import MAX_AMBIGUITIES

pytestmark = pytest.mark.usefixtures("clean_env")


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
