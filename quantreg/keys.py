"""The question quantreg answers: which method for this (quant format, model type, device[, layer kind]).

A key is plain strings so that it can be logged, cached and compared without vLLM.
A match is the rule-side pattern for a key: each field is a wildcard or a set of values.

The layer kind (issue 30) says which layers a decision is for: ``experts`` (vLLM's routed
experts, the only kind before it), ``attention`` (the attention's linear layers), ``dense``
(every other linear layer) and ``lm_head``. A key or rule that does not name it is about the
experts, so every table written before the layer kind existed keeps its decisions, its JSON and
its fingerprint: the kind is shown (``str``, :meth:`Key.as_json`, the rule JSON) only when it is
not ``experts``, and it never takes part in the three-field pattern hashing of the index.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import product
from typing import NamedTuple

from .bounds import MAX_COUNT, MAX_DIGITS

FIELDS: tuple[str, str, str] = ("quant_format", "model_type", "device")
WILDCARD = "*"
LAYER = "layer"
"""The optional fourth match key: which kind of layer a rule decides."""
EXPERTS = "experts"
LAYER_KINDS: tuple[str, ...] = (EXPERTS, "attention", "dense", "lm_head")
"""Every layer kind, in the order tools list them; ``experts`` is what an absent ``layer`` means."""
TOKENS = "tokens"
"""The optional match key on a forward's token count (issue 32): ``"<=N"``, ``"<N"``, ``">N"``, ``">=N"``."""
TOKENS_FORMS = ('"<=N"', '">N"', '">=N"', '"<N"')
_TOKENS_RE = re.compile(r"\s*(<=|>=|<|>)\s*([0-9]+)\s*")


@dataclass(frozen=True, order=True)
class TokenRange:
    """The token counts ``low..high`` (both inclusive; ``high`` ``None``: no upper bound) of a forward.

    Why a match key and not a key field: vLLM builds a layer's method once, but the token count is
    known only per forward. A key is decided once per process as before; rules that differ by their
    token range make that decision a *split* (:class:`quantreg.decision.TokenSide`), and the seam
    installs one method object that picks a side per forward (:mod:`quantreg.vllm.token_split`).
    """

    low: int = 1
    high: int | None = None

    @classmethod
    def parse(cls, text: str) -> TokenRange:
        """``"<=N"``, ``"<N"``, ``">N"`` or ``">=N"`` with N a positive integer; ValueError otherwise."""
        found = _TOKENS_RE.fullmatch(text)
        if found is None:
            raise ValueError(f"expected one of {', '.join(TOKENS_FORMS)} with N a positive integer")
        op, digits = found.group(1), found.group(2)
        if len(digits.lstrip("0")) > MAX_DIGITS:  # never int() of 5,000 digits (Python's own limit message)
            raise ValueError(f"N must be at most {MAX_COUNT:,} (a forward's token count), got a number of "
                             f"{len(digits.lstrip('0')):,} digits")
        n = int(digits)
        if n < 1:
            raise ValueError(f"N must be a positive integer (a forward has at least 1 token), got {n}")
        if n > MAX_COUNT:
            raise ValueError(f"N must be at most {MAX_COUNT:,} (a forward's token count), got {n:,}")
        if op == "<" and n == 1:
            raise ValueError('"<1" matches no forward (a forward has at least 1 token); write "<=N" or ">N"')
        return {"<=": cls(1, n), "<": cls(1, n - 1), ">": cls(n + 1, None), ">=": cls(n, None)}[op]

    def covers(self, tokens: int) -> bool:
        return tokens >= self.low and (self.high is None or tokens <= self.high)

    def intersects(self, other: TokenRange) -> bool:
        return (self.high is None or other.low <= self.high) and (other.high is None or self.low <= other.high)

    def contains(self, other: TokenRange) -> bool:
        """Every token count of ``other`` is in this range."""
        return other.low >= self.low and (self.high is None or (other.high is not None and other.high <= self.high))

    def __str__(self) -> str:
        """The form a table writes (``<=N``, ``>N``); a two-sided range (from a partition) as ``N..M``."""
        if self.high is None:
            return f">{self.low - 1}" if self.low > 1 else ">=1"
        if self.low == 1:
            return f"<={self.high}"
        return f"{self.low}..{self.high}"


@dataclass(frozen=True)
class MatchKey:
    """One more match key, declared once: what a rule may write, what a key carries, how they match.

    Every stage reads the declaration, so a new key is one entry in :data:`MATCH_KEYS` plus the
    line that puts its value into the key where it is known (docs/design.md, "Recipe: a match key"):
    the table parser (:mod:`quantreg.table.file`: a value or a list of values, located problems),
    :class:`Match` (matching, specificity, overlap for ambiguity, display in ``explain``/``rules``/
    ``plan``), the rule's JSON and fingerprint (:func:`quantreg.table.rules.rule_json`, only when
    written), the JSON Schema (:mod:`quantreg.table.schema`), :class:`Key` (equality, hash, JSON,
    display: only when not ``default``) and ``quantreg explain --NAME``.

    ``layer`` and ``tokens`` predate this table and keep their own code (``layer`` is never a
    wildcard and lives on ``Key.layer``; ``tokens`` is decided per forward, not per key).
    """

    name: str
    description: str
    """One line: the JSON Schema's description and ``explain --NAME``'s help."""
    values: tuple[str, ...] | None = None
    """The values a rule may name (a closed set, did-you-mean on a typo); ``None``: any match value."""
    default: str = ""
    """The value of a key that does not carry this one (what vLLM says when it says nothing)."""
    absent_matches_any: bool = True
    """A rule without the key matches every value (``True``), or only ``default`` (``False``: so
    that no rule written before the key existed starts deciding the new values)."""


MATCH_KEYS: tuple[MatchKey, ...] = ()
"""The match keys beyond quant_format / model_type / device / layer / tokens, in the order tools show them."""


def match_key(name: str) -> MatchKey:
    """The declaration of ``name`` (read through the module, so a test may declare a key for its run)."""
    for declared in MATCH_KEYS:
        if declared.name == name:
            return declared
    raise TypeError(f"unknown match key {name!r} (declared: {', '.join(k.name for k in MATCH_KEYS) or 'none'})")


class _KeyFields(NamedTuple):
    quant_format: str
    model_type: str
    device: str


class Key(_KeyFields):
    """One decision point; the values vLLM knows when it builds a layer (the kind defaults to the experts).

    Still a tuple of the three strings (``q, m, d = key``, ``*key``, ``_asdict()`` as before the
    layer kind existed); the kind is an attribute beside them, part of equality and hash only
    when it is not ``experts``, so an experts key still equals and hashes like its three values.
    Build a key from another with :func:`as_key`, not ``Key(*key)`` (which drops the kind).
    """

    layer: str = EXPERTS
    more: tuple[tuple[str, str], ...] = ()
    """Values of :data:`MATCH_KEYS` that differ from their default, sorted by name (a key without
    them equals, hashes and prints as before the key existed)."""

    def __new__(cls, quant_format: str, model_type: str, device: str, layer: str = EXPERTS, **more: str) -> Key:
        self = super().__new__(cls, quant_format, model_type, device)
        if layer != EXPERTS:
            self.__dict__["layer"] = layer
        kept = tuple(sorted((k, v) for k, v in more.items() if v != match_key(k).default))
        if kept:
            self.__dict__["more"] = kept
        return self

    def value(self, name: str) -> str:
        """This key's value of the match key ``name`` (its default when the key does not carry it)."""
        return dict(self.more).get(name, match_key(name).default)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, tuple):
            return NotImplemented
        return (tuple.__eq__(self, other) is True and self.layer == getattr(other, "layer", EXPERTS)
                and self.more == getattr(other, "more", ()))

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        if self.layer == EXPERTS and not self.more:
            return tuple.__hash__(self)
        return hash((*self, self.layer, self.more))

    def __repr__(self) -> str:
        shown = tuple.__repr__(self)
        extra = (f", layer={self.layer!r}" if self.layer != EXPERTS else "") + "".join(
            f", {k}={v!r}" for k, v in self.more)
        return f"Key{shown}" if not extra else f"Key{shown[:-1]}{extra})"

    def __str__(self) -> str:
        parts = [self.quant_format, self.model_type, self.device]
        if self.layer != EXPERTS:
            parts.append(self.layer)
        parts += [f"{k}={v}" for k, v in self.more]
        return f"({', '.join(parts)})"

    def _replace(self, **changes: str) -> Key:
        values = {**self._asdict(), "layer": self.layer, **dict(self.more), **changes}
        return Key(**values)

    def as_json(self) -> dict[str, str]:
        """The key as JSON; ``layer`` only when it is not ``experts``, so MoE keys keep their JSON (and a
        :data:`MATCH_KEYS` value only when it is not that key's default)."""
        data = {"quant_format": self.quant_format, "model_type": self.model_type, "device": self.device}
        if self.layer != EXPERTS:
            data["layer"] = self.layer
        data.update(self.more)
        return data

    def of_layer(self, layer: str) -> Key:
        """The same (quant format, model type, device, more) for another layer kind."""
        return Key(self.quant_format, self.model_type, self.device, layer, **dict(self.more))


def as_key(key: Key | tuple[str, ...]) -> Key:
    """``key`` itself if it is a :class:`Key` (keeping its kind), else a key of the (3 or 4) values."""
    return key if isinstance(key, Key) else Key(*key)


@dataclass(frozen=True)
class Match:
    """A rule's pattern: ``None`` in a field is the wildcard, otherwise the accepted values.

    Values are kept as sorted tuples so two equal patterns compare and hash equal.
    """

    quant_format: tuple[str, ...] | None = None
    model_type: tuple[str, ...] | None = None
    device: tuple[str, ...] | None = None
    layer: tuple[str, ...] | None = None
    """The layer kinds written in the rule; ``None`` (not written) means ``experts`` only. Never a
    wildcard: a rule that decides other layers says which, so no old rule starts deciding them."""
    tokens: TokenRange | None = None
    """The forward token counts the rule decides (``None``, not written: every count). Not hashed by
    the index: it splits a key's decision per forward (:meth:`quantreg.registry.Registry.resolve`)."""
    more: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """The :data:`MATCH_KEYS` the rule writes, sorted by name, each with its sorted values. Not hashed
    by the index (checked beside the hashed fields, like ``layer``)."""

    def fields(self) -> tuple[tuple[str, ...] | None, ...]:
        """The three hashed fields (the layer kind is checked beside them, see :attr:`layers`)."""
        return (self.quant_format, self.model_type, self.device)

    @property
    def layers(self) -> tuple[str, ...]:
        """The layer kinds this match decides."""
        return self.layer if self.layer is not None else (EXPERTS,)

    @property
    def specificity(self) -> int:
        """Number of non-wildcard fields written: the more a rule names, the more it wins.

        A written ``layer`` counts one (``{layer: lm_head}`` beats ``{layer: [dense, lm_head]}``
        only by priority, as two lists on any field do); an absent one counts nothing, so the
        specificity of every rule written without it is what it was. A written ``tokens`` counts
        one too: inside its range such a rule beats the same match without it, outside it the
        rule does not take part (docs/tables.md, "Token ranges").
        """
        return (sum(f is not None for f in self.fields()) + (self.layer is not None) + (self.tokens is not None)
                + len(self.more))

    @property
    def pattern(self) -> tuple[bool, bool, bool]:
        """Which fields are fixed; the index keeps one hash table per pattern."""
        q, m, d = (f is not None for f in self.fields())
        return (q, m, d)

    def matches(self, key: Key) -> bool:
        return self.unhashed_match(key) and all(f is None or v in f for f, v in zip(self.fields(), key))

    def unhashed_match(self, key: Key | tuple[str, ...]) -> bool:
        """Does ``key`` meet the fields the index does not hash (its layer kind, :data:`MATCH_KEYS`)?"""
        if not isinstance(key, Key):
            return EXPERTS in self.layers and all(self._accepts(k, k.default) for k in MATCH_KEYS)
        return key.layer in self.layers and all(self._accepts(k, key.value(k.name)) for k in MATCH_KEYS)

    def _accepts(self, declared: MatchKey, value: str) -> bool:
        written = self.written(declared)
        return value in written if written is not None else True

    def written(self, declared: MatchKey) -> tuple[str, ...] | None:
        """The values this match accepts for a :data:`MATCH_KEYS` key (``None``: every value)."""
        found = dict(self.more).get(declared.name)
        if found is None and not declared.absent_matches_any:
            return (declared.default,)
        return found

    def unhashed_overlap(self, other: Match) -> bool:
        """Can one key and forward meet both matches on the fields the index does not hash?"""
        if not self.layers_overlap(other) or not self.tokens_overlap(other):
            return False
        for declared in MATCH_KEYS:
            a, b = self.written(declared), other.written(declared)
            if a is not None and b is not None and set(a).isdisjoint(b):
                return False
        return True

    def overlaps(self, other: Match) -> bool:
        """True when some key matches both patterns (used to find ambiguous rules)."""
        if not self.unhashed_overlap(other):
            return False
        for a, b in zip(self.fields(), other.fields()):
            if a is not None and b is not None and not set(a) & set(b):
                return False
        return True

    def layers_overlap(self, other: Match) -> bool:
        """Do the two matches decide a common layer kind?"""
        return self.layers is other.layers or not set(self.layers).isdisjoint(other.layers)

    def tokens_overlap(self, other: Match) -> bool:
        """Can one forward match both token ranges (an absent range covers every count)?"""
        return self.tokens is None or other.tokens is None or self.tokens.intersects(other.tokens)

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
        if self.layer is not None and self.layer != (EXPERTS,):  # the experts' rules read as they always did
            parts.append(self.layer[0] if len(self.layer) == 1 else "[" + "|".join(self.layer) + "]")
        if self.tokens is not None:
            parts.append(f"tokens{self.tokens}")
        for name, values in self.more:
            parts.append(f"{name}={values[0]}" if len(values) == 1 else f"{name}=[{'|'.join(values)}]")
        return "(" + ", ".join(parts) + ")"
