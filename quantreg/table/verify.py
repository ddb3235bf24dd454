"""``verify:`` on a rule: what to check, how often, and how far apart is too far (no torch, no vLLM).

A registry that knows several methods for one key can run a second one beside the chosen one and
say, per layer, how far apart they are: bringing a kernel up on new hardware (or catching one that
regressed after a driver upgrade) becomes one table line instead of a hand-made A/B run::

    verify: {against: my_reference, every: 1000, first: 8, tolerance: 0.02, decoders: 2}

``decoders`` was spelled ``layers`` before issue 47: that word also names a rule's layer kinds
(``match.layer``, a method's ``layers:``) and the table tiers' old name, while this key counts or
lists *decoder blocks* (``model.layers.N``). The old spelling still reads, with one located
deprecation line (:data:`OLD_SPELLINGS`).

This module is the pure half: the spec (:class:`VerifySpec`), its located checks
(:func:`parse_verify`, called by :mod:`quantreg.table.file`), the sampling schedule and the error
measure. The vLLM half (shadow weights, the verifying method object, the reports) is
:mod:`quantreg.vllm.verify`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from ..bounds import MAX_COUNT, MAX_LAYERS, number_problem, shown, whole_problem
from ..error_measure import DEFAULT_TOLERANCE
from ..methods import keeps_vllm, valid_name
from ..problems import did_you_mean
from .located import mapping_key_lines

VERIFY_KEYS = ("against", "every", "first", "tolerance", "decoders")
OLD_SPELLINGS = {"layers": "decoders"}
"""Keys a table in the field may still write, and their spelling now (read the same, one deprecation line)."""
FLOAT64 = "float64"
"""``against: float64``: the format's float64 definition (:mod:`quantreg.models.gpt_oss_moe`)."""
FLOAT64_FORMATS = ("gpt_oss_mxfp4",)
"""Quant formats that have a float64 reference to verify against."""
DEFAULT_EVERY = 1000
DEFAULT_FIRST = 8
DEFAULT_DECODERS = 1
LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
"""The decoder-layer index in a MoE prefix such as ``model.layers.3.mlp.experts``."""

Fail = Callable[[int | None, str, str], None]


@dataclass(frozen=True)
class VerifySpec:
    """One rule's ``verify:``: run ``against`` beside the chosen method on sampled forward calls.

    ``first``: the first N forward calls of each verified layer are checked; ``every``: after
    them, one call in N. ``tolerance`` bounds ``max |out - ref| / max |ref|``. ``decoders`` is a
    count (the first N MoE layers) or decoder-layer indices (see :meth:`covers`).
    """

    against: str
    every: int = DEFAULT_EVERY
    first: int = DEFAULT_FIRST
    tolerance: float = DEFAULT_TOLERANCE
    decoders: int | tuple[int, ...] = DEFAULT_DECODERS

    def covers(self, layer_index: int | None, seen: Collection[int] = ()) -> bool:
        """Is the MoE layer with this decoder-layer index verified? (``None``: index unknown, no.)

        A list names decoder-layer indices. A count means the first N *MoE* layers: the N lowest
        indices among ``seen``, the MoE layers this process has built for the rule so far (this one
        included), so dense layers before the first MoE layer (DeepSeek-style models) do not count
        and building the same model twice does not move the window.
        """
        if layer_index is None:
            return False
        if isinstance(self.decoders, int):
            return layer_index in sorted({*seen, layer_index})[: self.decoders]
        return layer_index in self.decoders

    def next_call(self, calls: int) -> int:
        """The number (1-based) of the next verified forward call after ``calls`` calls.

        Calls ``1 .. first`` are verified, then ``first + every``, ``first + 2 * every``, ...:
        the hot path compares one counter with this number and does nothing else.
        """
        n = calls + 1
        if n <= self.first:
            return n
        return self.first + self.every * -(-(n - self.first) // self.every)

    def plan(self) -> str:
        """One line for ``explain`` and the start-up log."""
        layers = (f"the first {self.decoders} MoE layer{'s' if self.decoders != 1 else ''}"
                  if isinstance(self.decoders, int) else f"MoE layers {', '.join(map(str, self.decoders))}")
        return (f"against {self.against} on {layers}: the first {self.first} forward calls, then 1 in "
                f"{self.every}; tolerance {self.tolerance:g} on max|out-ref|/max|ref|")

    def to_json(self) -> dict[str, Any]:
        return {"against": self.against, "every": self.every, "first": self.first, "tolerance": self.tolerance,
                "decoders": self.decoders if isinstance(self.decoders, int) else list(self.decoders)}


def layer_index(prefix: str) -> int | None:
    """The decoder-layer index of a MoE prefix (``model.layers.3.mlp.experts`` -> 3), or ``None``."""
    m = LAYER_RE.search(prefix)
    return int(m.group(1)) if m else None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_verify(raw: Any, where: str, line: int, fail: Fail,
                 quant_formats: tuple[str, ...] | None, deprecated: Fail | None = None) -> VerifySpec | None:
    """Check a rule's ``verify:`` mapping; every fault goes to ``fail(line, key, message)``.

    ``quant_formats`` is the rule's ``match.quant_format`` (``None``: any), needed because
    ``against: float64`` exists only for formats with a float64 reference. Whether a named
    ``against`` method is registered is checked with the other method names
    (:func:`quantreg.loading.verify_problems`). An old spelling (:data:`OLD_SPELLINGS`) reads as
    its new one and goes to ``deprecated(line, key, message)``; both spellings at once is a fault.
    """
    key_lines = mapping_key_lines(raw, where, line, fail,
                                  "a mapping with 'against' (and every, first, tolerance, decoders)")
    if key_lines is None:
        return None
    ok = True
    written: dict[str, str] = {}  # new key -> the old spelling this rule used (problems name what is written)
    for old, new in OLD_SPELLINGS.items():
        if old in raw and new in raw:
            fail(key_lines.get(old, line), f"{where}.{old}", f"the old spelling of '{new}', which this rule also "
                                                              f"writes; keep only '{new}'")
            ok = False
        elif old in raw:
            if deprecated is not None:
                deprecated(key_lines.get(old, line), f"{where}.{old}",
                           f"deprecated spelling of '{new}' (read the same); write '{new}:'")
            raw = {**raw, new: raw[old]}
            written[new] = old
            key_lines = {**key_lines, new: key_lines.get(old, line)}
    for k in raw:
        if k not in VERIFY_KEYS and k not in OLD_SPELLINGS:
            fail(key_lines.get(k, line), f"{where}.{k}",
                 f"unknown key{did_you_mean(str(k), VERIFY_KEYS)} (expected one of: {', '.join(VERIFY_KEYS)})")
            ok = False

    def at(k: str) -> tuple[int, str]:
        return key_lines.get(k, line), f"{where}.{written.get(k, k)}"

    against = raw.get("against")
    if "against" not in raw:
        fail(line, f"{where}.against", f"missing; expected a registered method name or '{FLOAT64}'")
        ok = False
    elif not valid_name(against):
        fail(*at("against"), f"expected a method name or '{FLOAT64}', got {shown(against)}")
        ok = False
    elif keeps_vllm(against):
        fail(*at("against"), "cannot verify against 'vllm' (vLLM's own method is not built beside another); "
                             f"name a registered method or '{FLOAT64}'")
        ok = False
    elif against == FLOAT64:
        outside = ["*"] if quant_formats is None else [f for f in quant_formats if f not in FLOAT64_FORMATS]
        if outside:
            fail(*at("against"), f"'{FLOAT64}' needs a quant format with a float64 reference "
                                 f"({', '.join(FLOAT64_FORMATS)}); this rule matches quant_format "
                                 f"{', '.join(repr(f) for f in outside)}")
            ok = False
    values: dict[str, Any] = {}
    for k, low, what in (("every", 1, "a count of forward calls"), ("first", 0, "a count of forward calls")):
        if k in raw:
            v = raw[k]
            problem = whole_problem(v, low, MAX_COUNT, what)  # bounded: one counter compared per forward
            if problem:
                fail(*at(k), problem)
                ok = False
            else:
                values[k] = v
    if "tolerance" in raw:
        v = raw["tolerance"]
        if number_problem(v, 0, 1e9, low_open=True):  # never math.isfinite() of a 4,000-digit integer
            fail(*at("tolerance"), f"expected a positive number (a relative error such as 0.02), got {shown(v)}")
            ok = False
        else:
            values["tolerance"] = float(v)
    if "decoders" in raw:
        v = raw["decoders"]
        if _is_int(v) and 1 <= v <= MAX_LAYERS:
            values["decoders"] = v
        elif isinstance(v, list) and v and len(v) <= MAX_LAYERS and all(_is_int(x) and 0 <= x < MAX_LAYERS for x in v) \
                and len(set(v)) == len(v):
            values["decoders"] = tuple(sorted(v))
        else:
            got = shown(v) if not isinstance(v, list) else "an empty list" if not v else (
                f"list {', '.join(shown(x) for x in v[:4])}{', ...' if len(v) > 4 else ''}")
            fail(*at("decoders"), f"expected a count from 1 to {MAX_LAYERS:,} (the first N MoE layers) or a non-empty "
                                f"list of distinct layer indices from 0 to {MAX_LAYERS - 1:,}, got {got}"[:300])
            ok = False
    if not ok or not isinstance(against, str):
        return None
    return VerifySpec(against=against, **values)
