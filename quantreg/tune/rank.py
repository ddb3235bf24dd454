"""How ``quantreg tune`` turns measurements into a chain (no torch).

The score of a method is the weighted geometric mean of its median milliseconds per forward at
each measured token count, decode-weighted by default (:data:`PHASE_WEIGHTS`: 1 token counts half,
the two prefill sizes a quarter each): a server spends most forwards decoding, yet a method that
is 10x slower at prefill should not win on a 5 % decode edge. A geometric mean keeps one phase's
milliseconds from drowning the others'. Methods that failed (did not build, raised, or missed the
float64 reference's tolerance) have no score and are never in the chain.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TOKENS = (1, 64, 256)
"""Decode (1 token) and two prefill sizes, the token counts every method is timed at."""
PHASE_WEIGHTS: Mapping[int, float] = {1: 0.5, 64: 0.25, 256: 0.25}


@dataclass
class Result:
    """One method's outcome at one key: ``ok`` only if it built, ran and matched the reference."""

    method: str
    ok: bool = False
    error: str | None = None
    ms: dict[int, float | None] = field(default_factory=dict)
    rel_error: float | None = None
    samples: dict[int, list[float]] = field(default_factory=dict)

    def score(self, weights: Mapping[int, float] = PHASE_WEIGHTS) -> float | None:
        """Weighted geometric mean of the medians (ms); ``None`` unless ok and timed at every weighted count."""
        if not self.ok:
            return None
        total = sum(w for t, w in weights.items() if w > 0)
        logs = 0.0
        for tokens, weight in weights.items():
            if weight <= 0:
                continue
            value = self.ms.get(tokens)
            if value is None or value <= 0 or not math.isfinite(value):
                return None
            logs += weight * math.log(value)
        return math.exp(logs / total) if total > 0 else None

    def to_json(self, weights: Mapping[int, float] = PHASE_WEIGHTS) -> dict[str, Any]:
        score = self.score(weights)
        return {"method": self.method, "ok": self.ok, "error": self.error,
                "ms": {str(t): (None if v is None else round(v, 4)) for t, v in sorted(self.ms.items())},
                "score_ms": None if score is None else round(score, 4),
                "rel_error": None if self.rel_error is None else float(f"{self.rel_error:.4g}")}


def ranked(results: Sequence[Result], weights: Mapping[int, float] = PHASE_WEIGHTS) -> list[Result]:
    """Passing methods fastest first (ties by name, so the order is deterministic), then the failed ones."""
    passing = [r for r in results if r.score(weights) is not None]
    failing = [r for r in results if r.score(weights) is None]
    passing.sort(key=lambda r: (r.score(weights), r.method))
    return passing + sorted(failing, key=lambda r: r.method)


def chain(results: Sequence[Result], weights: Mapping[int, float] = PHASE_WEIGHTS) -> list[str]:
    """The methods a tuned rule names, fastest first: only those that passed."""
    return [r.method for r in ranked(results, weights) if r.score(weights) is not None]


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median of no values")
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2
