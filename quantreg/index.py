"""Precedence, ambiguity and fast lookup over all loaded rules.

Precedence (documented in the README): a rule from a higher layer beats any rule from a
lower one; within a layer the more specific rule (more non-wildcard fields) wins; then the
higher ``priority``. Two rules of one layer with equal specificity and priority that can
match the same key are ambiguous, which is a load-time error naming both.

Lookup never scans the table: rules are hashed per *pattern* (which of the three fields are
fixed), so a key costs at most eight dictionary probes plus the rules that really match.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from itertools import product

from .keys import Key
from .located import gc_paused
from .problems import Problem
from .tables import Rule

Pattern = tuple[bool, bool, bool]
PATTERNS: tuple[Pattern, ...] = tuple(product((False, True), repeat=3))  # type: ignore[arg-type]
MAX_AMBIGUITIES = 50


def _project(values: Sequence[str], pattern: Pattern) -> tuple[str, ...]:
    return tuple(v for v, keep in zip(values, pattern) if keep)


class Index:
    """Immutable lookup structure built once per effective table."""

    def __init__(self, rules: Iterable[Rule]) -> None:
        with gc_paused():  # one list and key tuple per rule, no cycles; see located.gc_paused
            self.rules: tuple[Rule, ...] = tuple(rules)
            self._order = {id(r): i for i, r in enumerate(self.rules)}
            self._by_pattern: dict[Pattern, dict[tuple[str, ...], list[Rule]]] = {}
            for rule in self.rules:
                pattern = rule.match.pattern
                table = self._by_pattern.setdefault(pattern, defaultdict(list))
                for values in rule.match.expand(pattern):
                    table[values].append(rule)

    def candidates(self, key: Key) -> list[Rule]:
        """Every rule matching ``key``, best first (ties keep file order)."""
        found: list[Rule] = []
        for pattern, table in self._by_pattern.items():
            found.extend(table.get(_project(key, pattern), ()))
        found.sort(key=lambda r: (tuple(-x for x in r.rank), self._order[id(r)]))
        return found

    def ambiguities(self) -> list[Problem]:
        """One problem per ambiguous pair (see :meth:`ambiguous_pairs`), sorted by file and line."""
        return ambiguity_problems(self.ambiguous_pairs())

    def ambiguous_pairs(self) -> list[tuple[Rule, Rule]]:
        """Pairs of rules (in file order) that tie on (layer, specificity, priority) and overlap.

        Rules are grouped by their rank; inside a group, for every pair of patterns the
        rules are hashed on the fields both fix, so only overlapping pairs are compared.
        """
        with gc_paused():
            return self._ambiguous_pairs()

    def _ambiguous_pairs(self) -> list[tuple[Rule, Rule]]:
        groups: dict[tuple[int, int, int], list[Rule]] = defaultdict(list)
        for rule in self.rules:
            groups[rule.rank].append(rule)
        pairs: list[tuple[Rule, Rule]] = []
        seen: set[tuple[int, int]] = set()
        for group in groups.values():
            if len(group) < 2:
                continue
            by_pattern: dict[Pattern, list[Rule]] = defaultdict(list)
            for rule in group:
                by_pattern[rule.match.pattern].append(rule)
            pats = list(by_pattern)
            for i, pa in enumerate(pats):
                for pb in pats[i:]:
                    common: Pattern = (pa[0] and pb[0], pa[1] and pb[1], pa[2] and pb[2])
                    buckets: dict[tuple[str, ...], list[Rule]] = defaultdict(list)
                    for ra in by_pattern[pa]:
                        for values in ra.match.expand(common):
                            buckets[values].append(ra)
                    for rb in by_pattern[pb]:
                        for values in rb.match.expand(common):
                            for ra in buckets.get(values, ()):
                                if ra is rb:
                                    continue
                                a, b = sorted((ra, rb), key=lambda r: self._order[id(r)])
                                pair = (self._order[id(a)], self._order[id(b)])
                                if pair in seen:
                                    continue
                                seen.add(pair)
                                pairs.append((a, b))
                                if len(pairs) >= MAX_AMBIGUITIES:
                                    return pairs
        return pairs


def ambiguity_problems(pairs: Iterable[tuple[Rule, Rule]]) -> list[Problem]:
    """One problem per pair, at the later rule and naming the earlier one, sorted by file and line."""
    return sorted((_ambiguity(a, b) for a, b in pairs), key=lambda p: (p.path, p.line or 0))


def _ambiguity(a: Rule, b: Rule) -> Problem:
    return Problem(
        b.path,
        b.line,
        f"{b.where}.match" if b.where else "match",
        f"ambiguous: rule {b.match} and rule {a.location} {a.match} can both match the same key with "
        f"equal specificity ({a.match.specificity}) and priority ({a.priority}) in the {a.layer} layer; "
        "make one more specific or give one a higher priority",
    )
