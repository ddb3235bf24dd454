"""The question quantreg answers: which MoE method for this (quant format, model type, device).

A key is three plain strings so that it can be logged, cached and compared without vLLM.
A match is the rule-side pattern for a key: each field is a wildcard or a set of values.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import product
from typing import NamedTuple

FIELDS: tuple[str, str, str] = ("quant_format", "model_type", "device")
WILDCARD = "*"


class Key(NamedTuple):
    """One decision point; the same three values vLLM knows when it builds a MoE layer."""

    quant_format: str
    model_type: str
    device: str

    def __str__(self) -> str:
        return f"({self.quant_format}, {self.model_type}, {self.device})"


@dataclass(frozen=True)
class Match:
    """A rule's pattern: ``None`` in a field is the wildcard, otherwise the accepted values.

    Values are kept as sorted tuples so two equal patterns compare and hash equal.
    """

    quant_format: tuple[str, ...] | None = None
    model_type: tuple[str, ...] | None = None
    device: tuple[str, ...] | None = None

    def fields(self) -> tuple[tuple[str, ...] | None, ...]:
        return (self.quant_format, self.model_type, self.device)

    @property
    def specificity(self) -> int:
        """Number of non-wildcard fields: the more a rule names, the more it wins."""
        return sum(f is not None for f in self.fields())

    @property
    def pattern(self) -> tuple[bool, bool, bool]:
        """Which fields are fixed; the index keeps one hash table per pattern."""
        q, m, d = (f is not None for f in self.fields())
        return (q, m, d)

    def matches(self, key: Key) -> bool:
        return all(f is None or v in f for f, v in zip(self.fields(), key))

    def overlaps(self, other: Match) -> bool:
        """True when some key matches both patterns (used to find ambiguous rules)."""
        for a, b in zip(self.fields(), other.fields()):
            if a is not None and b is not None and not set(a) & set(b):
                return False
        return True

    def expand(self, fixed: tuple[bool, bool, bool]) -> Iterator[tuple[str, ...]]:
        """Every concrete tuple of values on the ``fixed`` fields (all must be fixed here)."""
        chosen = [f or () for f, keep in zip(self.fields(), fixed) if keep]
        yield from product(*chosen)

    def __str__(self) -> str:
        return self.short(limit=None)

    def short(self, limit: int | None = 6) -> str:
        """Like ``str()``, but a list of more than ``limit`` values shows its first ones and ``+N``.

        Messages about wide rules (hundreds of values per field) stay one readable line.
        """
        parts = []
        for f in self.fields():
            if f is None:
                parts.append(WILDCARD)
            elif len(f) == 1:
                parts.append(f[0])
            elif limit is not None and len(f) > limit:
                parts.append("[" + "|".join(f[:limit]) + f"|... +{len(f) - limit}]")
            else:
                parts.append("[" + "|".join(f) + "]")
        return "(" + ", ".join(parts) + ")"
