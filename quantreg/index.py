"""Precedence, ambiguity and fast lookup over all loaded rules.

Precedence (documented in docs/tables.md): a rule from a higher tier beats any rule from a
lower one; within a tier the more specific rule (more non-wildcard fields) wins; then the
higher ``priority``. Two rules of one tier with equal specificity and priority that can
match the same key are ambiguous, which is a load-time error naming both.

Lookup never scans the table: rules are hashed per *pattern* (which of the three fields are
fixed), so a key costs at most eight dictionary probes plus the rules that really match. A
rule's value lists are expanded into hash keys only while that is about as cheap as the rule's
text; wider rules go to a per-field inverted index (see :class:`Index`), so no table under the
size cap can blow up memory through a cross product.

The layer kind (``Match.layer``, issue 30) is not hashed: few rules name it, so the index hashes
the three fields as before and drops candidates of another kind (one tuple test per candidate),
and two rules of disjoint kinds are never ambiguous. The token range (``Match.tokens``, issue 32)
is not hashed either: two rules whose ranges are disjoint (``<=64`` and ``>64``) are never
ambiguous; overlapping ranges at equal rank are, like any other overlap.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from itertools import product

from .keys import Key
from .problems import Problem
from .table.file import Rule
from .table.located import gc_paused

Pattern = tuple[bool, bool, bool]
PATTERNS: tuple[Pattern, ...] = tuple(product((False, True), repeat=3))  # type: ignore[arg-type]
MAX_AMBIGUITIES = 50


def _project(values: Sequence[str], pattern: Pattern) -> tuple[str, ...]:
    return tuple(v for v, keep in zip(values, pattern) if keep)


def _expand_cost(match_fields: Sequence[tuple[str, ...] | None], fixed: Pattern) -> tuple[int, int]:
    """(product, sum) of the value counts on the ``fixed`` fields: what expanding would cost vs. the text."""
    prod, total = 1, 0
    for values, keep in zip(match_fields, fixed):
        if keep:
            n = len(values or ())
            prod *= n
            total += n
    return prod, total


def _narrow(rule: Rule, fixed: Pattern) -> bool:
    """Expand a rule into hash keys only while that costs about as much as its text.

    A rule naming one list (``device: [cpu, cuda, hpu]``) expands to as many keys as it has
    values; a rule naming 220 values on each of three fields would expand to 10.6 M keys (2 GB),
    so such "wide" rules are looked up through a per-field inverted index instead.
    """
    prod, total = _expand_cost(rule.match.fields(), fixed)
    return prod <= max(16, 2 * total)


class Index:
    """Immutable lookup structure built once per effective table.

    Narrow rules (see :func:`_narrow`) are hashed per pattern on their expanded value tuples: a
    key costs at most eight dictionary probes. Wide rules are indexed once, on the values of
    their smallest fixed field, and checked against the key's other fields with sets, so memory
    stays linear in the table's text whatever its lists.
    """

    def __init__(self, rules: Iterable[Rule]) -> None:
        with gc_paused():  # one list and key tuple per rule, no cycles; see located.gc_paused
            self.rules: tuple[Rule, ...] = tuple(rules)
            self._order = {id(r): i for i, r in enumerate(self.rules)}
            self._by_pattern: dict[Pattern, dict[tuple[str, ...], list[Rule]]] = {}
            # field -> value -> wide rules indexed on that field, each with its value sets
            self._wide: dict[int, dict[str, list[tuple[Rule, tuple[frozenset[str] | None, ...]]]]] = {}
            for rule in self.rules:
                pattern = rule.match.pattern
                if _narrow(rule, pattern):
                    table = self._by_pattern.setdefault(pattern, defaultdict(list))
                    for values in rule.match.expand(pattern):
                        table[values].append(rule)
                    continue
                fields = rule.match.fields()
                sets = tuple(None if f is None else frozenset(f) for f in fields)
                pick = min((i for i, f in enumerate(fields) if f is not None), key=lambda i: len(fields[i] or ()))
                by_value = self._wide.setdefault(pick, defaultdict(list))
                for value in fields[pick] or ():
                    by_value[value].append((rule, sets))

    def candidates(self, key: Key) -> list[Rule]:
        """Every rule matching ``key``, best first (ties keep file order)."""
        found: list[Rule] = []
        for pattern, table in self._by_pattern.items():
            found.extend(table.get(_project(key, pattern), ()))
        for pick, by_value in self._wide.items():
            for rule, sets in by_value.get(key[pick], ()):
                if all(s is None or v in s for s, v in zip(sets, key)):
                    found.append(rule)
        found = [r for r in found if r.match.unhashed_match(key)]  # layer kind, declared match keys
        found.sort(key=lambda r: (tuple(-x for x in r.rank), self._order[id(r)]))
        return found

    def ambiguities(self) -> list[Problem]:
        """One problem per ambiguous pair (see :meth:`ambiguous_pairs`), sorted by file and line."""
        return ambiguity_problems(self.ambiguous_pairs())

    def ambiguous_pairs(self) -> list[tuple[Rule, Rule]]:
        """Pairs of rules (in file order) that tie on (tier, specificity, priority) and overlap.

        Two rules overlap iff, on every field both fix, their value sets intersect. Rules are
        grouped by rank, then by pattern; for each pair of patterns, narrow rules are hashed on
        the expanded values of the fields both fix (an exact test), and wide ones are compared
        through a per-field inverted index (value -> rules), probing the field with the fewest
        candidates and checking the others with sets. Nothing expands a large list product.
        """
        with gc_paused():
            return self._ambiguous_pairs()

    def _ambiguous_pairs(self) -> list[tuple[Rule, Rule]]:
        groups: dict[tuple[int, int, int], list[Rule]] = defaultdict(list)
        for rule in self.rules:
            groups[rule.rank].append(rule)
        pairs: list[tuple[Rule, Rule]] = []
        seen: set[tuple[int, int]] = set()
        order = self._order

        def add(ra: Rule, rb: Rule) -> bool:
            """Record a pair once (if they decide a common layer kind and token count); True when the report is full."""
            if not ra.match.unhashed_overlap(rb.match):
                return False
            a, b = (ra, rb) if order[id(ra)] < order[id(rb)] else (rb, ra)
            pair = (order[id(a)], order[id(b)])
            if pair not in seen:
                seen.add(pair)
                pairs.append((a, b))
            return len(pairs) >= MAX_AMBIGUITIES

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
                    if _pairs_for(by_pattern[pa], by_pattern[pb], common, add):
                        return pairs
        return pairs


def _pairs_for(side_a: list[Rule], side_b: list[Rule], common: Pattern,
               add: Callable[[Rule, Rule], bool]) -> bool:
    """Report every overlapping (a, b) with a in ``side_a``, b in ``side_b``; True when the report is full."""
    fields = [i for i, keep in enumerate(common) if keep]
    if not fields:  # no field fixed by both: every pair overlaps
        for ra in side_a:
            for rb in side_b:
                if ra is not rb and add(ra, rb):
                    return True
        return False
    buckets: dict[tuple[str, ...], list[Rule]] = defaultdict(list)
    inverted: dict[int, dict[str, list[Rule]]] = {f: defaultdict(list) for f in fields}  # wide rules of side a
    everyone: dict[int, dict[str, list[Rule]]] = {f: defaultdict(list) for f in fields}  # all rules of side a
    narrow_b = [_narrow(rb, common) for rb in side_b]
    any_wide_b = not all(narrow_b)
    any_wide_a = False
    for ra in side_a:
        values = ra.match.fields()
        if _narrow(ra, common):
            for t in ra.match.expand(common):
                buckets[t].append(ra)
        else:
            any_wide_a = True
            for f in fields:
                for v in values[f] or ():
                    inverted[f][v].append(ra)
        if any_wide_b:  # only a wide rule of side b probes every rule of side a
            for f in fields:
                for v in values[f] or ():
                    everyone[f][v].append(ra)
    for rb, narrow in zip(side_b, narrow_b):
        values = rb.match.fields()
        if narrow:
            for t in rb.match.expand(common):
                for ra in buckets.get(t, ()):
                    if ra is not rb and add(ra, rb):
                        return True
            if not any_wide_a:
                continue
            index = inverted  # narrow vs narrow is exact above; only wide rules of side a are left
        else:
            index = everyone
        # probe the field whose postings are shortest, check the other fields with sets
        best = min(fields, key=lambda f: sum(len(index[f].get(v, ())) for v in values[f] or ()))
        sets = {f: frozenset(values[f] or ()) for f in fields if f != best}
        checked: set[int] = set()
        for v in values[best] or ():
            for ra in index[best].get(v, ()):
                if ra is rb or id(ra) in checked:
                    continue
                checked.add(id(ra))
                other = ra.match.fields()
                if all(not sets[f].isdisjoint(other[f] or ()) for f in sets) and add(ra, rb):
                    return True
    return False


def ambiguity_problems(pairs: Iterable[tuple[Rule, Rule]]) -> list[Problem]:
    """One problem per pair, at the later rule and naming the earlier one, sorted by file and line."""
    return sorted((_ambiguity(a, b) for a, b in pairs), key=lambda p: (p.path, p.line or 0))


def _ambiguity(a: Rule, b: Rule) -> Problem:
    return Problem(
        b.path,
        b.line,
        f"{b.where}.match" if b.where else "match",
        f"ambiguous: rule {b.match.short()} and rule {a.location} {a.match.short()} can both match the same key"
        f"{' and token count' if a.match.tokens is not None or b.match.tokens is not None else ''} with "
        f"equal specificity ({a.match.specificity}) and priority ({a.priority}) in the {a.tier} tier; "
        "make one more specific or give one a higher priority",
    )
