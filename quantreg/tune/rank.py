"""How ``quantreg tune`` turns measurements into a chain (no torch).

The score of a method is the weighted geometric mean of its median milliseconds per forward at
each measured token count, decode-weighted by default (:data:`PHASE_WEIGHTS`: 1 token counts half,
the two prefill sizes a quarter each): a server spends most forwards decoding, yet a method that
is 10x slower at prefill should not win on a 5 % decode edge. A geometric mean keeps one phase's
milliseconds from drowning the others'. Methods that failed (did not build, raised, or missed the
float64 reference's tolerance) have no score and are never in the chain.

Same answer twice (issue 32): on a shared 2-core host one noisy round must not decide a table.
Two methods are ranked apart only when the difference is **beyond the measured noise**: the
rounds are interleaved, so round *i* gives every method a paired sample; the per-round log ratio
of two methods' round scores is bootstrapped (:data:`BOOTSTRAP` resamples, a fixed seed so the
same samples always give the same answer) into a 95 % interval of the median ratio, and the
pair is apart only when that whole interval is beyond :data:`MARGIN` (5 %). Otherwise it is a
"tie (within noise)" and the pair keeps the order the chain already had (the registry's current
chain for the key, then names): a re-run on the same host then writes the same chain.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TOKENS = (1, 64, 256)
"""Decode (1 token) and two prefill sizes, the token counts every method is timed at."""
PHASE_WEIGHTS: Mapping[int, float] = {1: 0.5, 64: 0.25, 256: 0.25}
MARGIN = 0.05
"""Two methods are apart only if one is faster by more than this fraction with 95 % confidence."""
BOOTSTRAP = 2000
"""Resamples of the per-round log ratios (a fixed seed: the same samples give the same interval)."""
MIN_PAIRED_ROUNDS = 3
"""Fewer paired rounds than this: no interval; only a ratio beyond :data:`FEW_ROUNDS_MARGIN` separates."""
FEW_ROUNDS_MARGIN = 0.5
SHARP_FALL = 0.5
"""Sanity: a method's median at more tokens below this fraction of its median at fewer is suspect."""
OUTLIER = 3.0
"""Sanity: a round slower than this many times the method's median at that count is an outlier."""


@dataclass
class Result:
    """One method's outcome at one key: ``ok`` only if it built, ran and matched the reference."""

    method: str
    ok: bool = False
    error: str | None = None
    ms: dict[int, float | None] = field(default_factory=dict)
    rel_error: float | None = None
    samples: dict[int, list[float]] = field(default_factory=dict)
    """Milliseconds per timing round (index = round, aligned across methods: rounds are interleaved)."""
    warnings: list[str] = field(default_factory=list)
    """What the sanity checks found (time falling with token count, outliers): shown, never hidden."""

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
        data = {"method": self.method, "ok": self.ok, "error": self.error,
                "ms": {str(t): (None if v is None else round(v, 4)) for t, v in sorted(self.ms.items())},
                "score_ms": None if score is None else round(score, 4),
                "rel_error": None if self.rel_error is None else float(f"{self.rel_error:.4g}")}
        spread = self.spread()
        if spread:
            data["spread"] = {str(t): round(v, 4) for t, v in sorted(spread.items())}
        if self.warnings:
            data["warnings"] = list(self.warnings)
        return data

    def spread(self) -> dict[int, float]:
        """Per token count: the interquartile range of the rounds over their median (the noise seen)."""
        out = {}
        for tokens, values in self.samples.items():
            if len(values) >= 2 and self.ms.get(tokens):
                q1, q3 = quantile(values, 0.25), quantile(values, 0.75)
                out[tokens] = (q3 - q1) / float(self.ms[tokens] or 1.0)
        return out

    def round_scores(self, weights: Mapping[int, float] = PHASE_WEIGHTS) -> list[float]:
        """The weighted geometric mean of each timing round (paired with other methods' same round)."""
        counts = [t for t, w in weights.items() if w > 0]
        if not counts or any(not self.samples.get(t) for t in counts):
            return []
        n = min(len(self.samples[t]) for t in counts)
        total = sum(weights[t] for t in counts)
        scores = []
        for i in range(n):
            values = [self.samples[t][i] for t in counts]
            if any(v <= 0 or not math.isfinite(v) for v in values):
                continue
            scores.append(math.exp(sum(weights[t] * math.log(self.samples[t][i]) for t in counts) / total))
        return scores


@dataclass(frozen=True)
class Comparison:
    """``first`` against ``second``: the median round ratio (first / second) and its 95 % interval."""

    first: str
    second: str
    ratio: float
    low: float
    high: float
    rounds: int

    @property
    def apart(self) -> bool:
        """``first`` faster (or slower) than ``second`` beyond the noise and the margin."""
        if self.rounds >= MIN_PAIRED_ROUNDS:
            return self.high < 1.0 / (1.0 + MARGIN) or self.low > 1.0 + MARGIN
        return self.ratio < FEW_ROUNDS_MARGIN or self.ratio > 1.0 / FEW_ROUNDS_MARGIN

    def text(self) -> str:
        how = (f"median round ratio {self.ratio:.3g} (95 % interval {self.low:.3g}-{self.high:.3g}, "
               f"{self.rounds} paired rounds)" if self.rounds >= MIN_PAIRED_ROUNDS
               else f"score ratio {self.ratio:.3g} ({self.rounds} paired rounds: no interval)")
        if self.apart:
            verdict = "faster" if self.ratio < 1.0 else "slower"
            return f"{self.first} before {self.second}: {verdict} beyond noise, {how}"
        return f"{self.first} before {self.second}: tie (within noise, margin {MARGIN:.0%}), {how}; chain order kept"


def compare(a: Result, b: Result, weights: Mapping[int, float] = PHASE_WEIGHTS) -> Comparison:
    """``a`` / ``b`` by paired rounds (bootstrap interval of the median log ratio), else by score."""
    sa, sb = a.round_scores(weights), b.round_scores(weights)
    n = min(len(sa), len(sb))
    if n >= MIN_PAIRED_ROUNDS:
        logs = [math.log(sa[i] / sb[i]) for i in range(n)]
        rng = random.Random(0x5EED ^ n)  # fixed: the same rounds always give the same interval
        meds = sorted(median([logs[rng.randrange(n)] for _ in range(n)]) for _ in range(BOOTSTRAP))
        low, high = meds[int(0.025 * BOOTSTRAP)], meds[int(0.975 * BOOTSTRAP) - 1]
        return Comparison(a.method, b.method, math.exp(median(logs)), math.exp(low), math.exp(high), n)
    score_a, score_b = a.score(weights), b.score(weights)
    ratio = (score_a / score_b) if score_a and score_b else 1.0
    return Comparison(a.method, b.method, ratio, ratio, ratio, n)


def prior_order(names: Sequence[str], prior: Sequence[str]) -> list[str]:
    """``names`` in the chain's existing order: those ``prior`` lists in its order, then the rest by name."""
    position = {m: i for i, m in enumerate(prior)}
    return sorted(names, key=lambda m: (position.get(m, len(position)), m))


def order_with_noise(results: Sequence[Result], weights: Mapping[int, float] = PHASE_WEIGHTS,
                     prior: Sequence[str] = ()) -> tuple[list[Result], list[Comparison]]:
    """Passing methods, moved ahead of one another only when faster beyond noise; the verdicts.

    Starts from :func:`prior_order` and swaps neighbours only when the later one is faster beyond
    noise (at most ``n`` passes: the order is a fixed function of the samples, never of luck).
    Returns the order and the comparison of each neighbouring pair in it.
    """
    by_name = {r.method: r for r in results if r.score(weights) is not None}
    order = prior_order(list(by_name), prior)
    for _ in range(len(order)):
        moved = False
        for i in range(len(order) - 1):
            c = compare(by_name[order[i + 1]], by_name[order[i]], weights)
            if c.apart and c.ratio < 1.0:
                order[i], order[i + 1] = order[i + 1], order[i]
                moved = True
        if not moved:
            break
    verdicts = [compare(by_name[order[i]], by_name[order[i + 1]], weights) for i in range(len(order) - 1)]
    return [by_name[m] for m in order], verdicts


def ranked(results: Sequence[Result], weights: Mapping[int, float] = PHASE_WEIGHTS,
           prior: Sequence[str] = ()) -> list[Result]:
    """Passing methods in chain order (apart only beyond noise, else the prior order), then the failed ones."""
    passing, _ = order_with_noise(results, weights, prior)
    failing = [r for r in results if r.score(weights) is None]
    return passing + sorted(failing, key=lambda r: r.method)


def chain(results: Sequence[Result], weights: Mapping[int, float] = PHASE_WEIGHTS,
          prior: Sequence[str] = ()) -> list[str]:
    """The methods a tuned rule names, in chain order: only those that passed."""
    return [r.method for r in order_with_noise(results, weights, prior)[0]]


def sanity(result: Result) -> list[str]:
    """What is wrong with ``result``'s measurements (empty when they look sane).

    Time must not fall sharply as the token count grows (a forward over more tokens does at least
    the work of fewer: a sharp fall means a noisy round decided a median), and rounds far slower
    than their median are outliers (counted; the median already resists them).
    """
    found = []
    counts = sorted(t for t, v in result.ms.items() if v)
    for small, big in itertools.pairwise(counts):
        a, b = result.ms[small], result.ms[big]
        if a and b and b < SHARP_FALL * a:
            found.append(f"time falls with token count: {b:.3g} ms at {big} tokens < {SHARP_FALL:g} x "
                         f"{a:.3g} ms at {small} (noise decided a median)")
    for tokens in counts:
        values = result.samples.get(tokens, [])
        mid = result.ms[tokens] or 0.0
        slow = [v for v in values if mid and v > OUTLIER * mid]
        if slow:
            found.append(f"{len(slow)} of {len(values)} rounds at {tokens} token{'s' if tokens != 1 else ''} "
                         f"over {OUTLIER:g} x the median (outliers; the median is kept)")
    return found


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile ``q`` (0..1) of ``values``."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("quantile of no values")
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median of no values")
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2


# -- one rule for decode and prefill: the crossover (issue 32, item 3) ---------------------------

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""The token counts ``tune`` times by default: decode (1) up to a long prefill chunk (512), doubling,
so a crossover is located within a factor of two. :data:`TOKENS` (the score's counts) are always among them."""
ENVELOPE_MARGIN = MARGIN
"""The envelope (what the written rules give each token count) must be within this of the best method."""


def at_tokens(a: Result, b: Result, tokens: int) -> Comparison:
    """``a`` / ``b`` at one token count: the same paired-round bootstrap as the ranking, on that count alone."""
    return compare(a, b, {tokens: 1.0})


def curve(results: Sequence[Result], counts: Sequence[int]) -> dict[str, dict[str, dict[str, float | None]]]:
    """The evidence of a crossover: per passing method, per token count, the median ms and the spread."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for r in results:
        if not r.ok:
            continue
        spread = r.spread()
        out[r.method] = {str(t): {"ms": None if r.ms.get(t) is None else round(float(r.ms[t] or 0.0), 4),
                                  "spread": None if t not in spread else round(spread[t], 4)} for t in counts}
    return out


@dataclass
class Envelope:
    """What a set of rules gives each measured token count, against the fastest method there.

    ``ok`` follows the ranking's noise rule: the envelope fails at a token count only where some
    method is faster than the envelope's method **beyond noise** by more than :data:`ENVELOPE_MARGIN`
    (the 95 % interval of the paired round ratio entirely below ``1 / 1.05``). ``ratios`` are the
    plain median ratios (envelope / best), reported whatever the verdict.
    """

    methods: dict[int, str]
    best: dict[int, str]
    ratios: dict[int, float]
    beaten: list[tuple[int, Comparison]]

    @property
    def ok(self) -> bool:
        return not self.beaten

    @property
    def worst(self) -> tuple[int, float]:
        """The token count where the envelope is furthest from the best, and that ratio."""
        if not self.ratios:
            return 0, 1.0
        t = max(sorted(self.ratios), key=lambda k: self.ratios[k])
        return t, self.ratios[t]

    def text(self) -> str:
        t, ratio = self.worst
        worst = f"worst x{ratio:.3f} of the best ({self.best[t]}) at {_tok(t)}"
        if self.ok and ratio <= 1.0 + ENVELOPE_MARGIN:
            return f"within {ENVELOPE_MARGIN:.0%} of the best method at every measured token count ({worst})"
        if self.ok:
            return (f"within noise of the best method at every measured token count ({worst}: over "
                    f"{ENVELOPE_MARGIN:.0%} by the medians, not beyond noise)")
        where = "; ".join(f"at {_tok(t)}: {c.first} faster than {c.second} beyond noise (median ratio {c.ratio:.3g},"
                          f" 95 % interval {c.low:.3g}-{c.high:.3g})" for t, c in self.beaten)
        return f"NOT within {ENVELOPE_MARGIN:.0%} of the best method ({worst}); {where}"

    def to_json(self) -> dict[str, Any]:
        t, ratio = self.worst
        return {"ok": self.ok, "methods": {str(k): v for k, v in sorted(self.methods.items())},
                "best": {str(k): v for k, v in sorted(self.best.items())},
                "ratio_to_best": {str(k): round(v, 4) for k, v in sorted(self.ratios.items())},
                "worst_ratio": round(ratio, 4), "worst_at": t, "text": self.text()}


def envelope(results: Sequence[Result], methods: Mapping[int, str]) -> Envelope:
    """Check the envelope ``methods`` (token count -> method) against every passing method."""
    by_name = {r.method: r for r in results if r.ok}
    best: dict[int, str] = {}
    ratios: dict[int, float] = {}
    beaten: list[tuple[int, Comparison]] = []
    for t, chosen in sorted(methods.items()):
        timed = {n: r for n, r in by_name.items() if r.ms.get(t)}
        if chosen not in timed:  # not measured there: nothing to compare (split() never asks for it)
            continue
        best[t] = min(sorted(timed), key=lambda n: float(timed[n].ms[t] or 0.0))
        ratios[t] = float(timed[chosen].ms[t] or 0.0) / float(timed[best[t]].ms[t] or 1.0)
        for name in sorted(timed):
            if name == chosen:
                continue
            c = at_tokens(timed[name], timed[chosen], t)
            if c.rounds >= MIN_PAIRED_ROUNDS and c.high < 1.0 / (1.0 + ENVELOPE_MARGIN):
                beaten.append((t, c))
                break
    return Envelope(dict(methods), best, ratios, beaten)


@dataclass
class Crossover:
    """One split: ``small`` for forwards of at most ``tokens`` tokens, ``large`` above; its envelope."""

    tokens: int
    small: str
    large: str
    small_wins: list[int]
    large_wins: list[int]
    envelope: Envelope

    def text(self) -> str:
        return (f"crossover at {_tok(self.tokens)}: {self.small} for <= {self.tokens} (faster than {self.large} "
                f"beyond noise at {_counts(self.small_wins)}), {self.large} above (faster beyond noise at "
                f"{_counts(self.large_wins)}); envelope {self.envelope.text()}")

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "small": self.small, "large": self.large,
                "small_wins": self.small_wins, "large_wins": self.large_wins, "envelope": self.envelope.to_json(),
                "text": self.text()}


@dataclass
class Split:
    """What tune decided about token counts: a :class:`Crossover`, or why one method serves them all."""

    counts: list[int]
    single: str | None
    single_envelope: Envelope | None
    crossover: Crossover | None = None
    candidates: list[Crossover] = field(default_factory=list)

    def text(self) -> str:
        if self.single is None:
            return "no method passed"
        if self.single_envelope is None:
            return (f"no crossover: one method for every token count ({self.single}); the methods were not "
                    f"timed at every count of {', '.join(map(str, self.counts))}")
        if self.crossover is not None:
            return self.crossover.text()
        lines = (f"no crossover: one method for every token count ({self.single}, envelope "
                 f"{self.single_envelope.text()})")
        if not self.single_envelope.ok:
            best = min(self.candidates, key=lambda c: c.envelope.worst[1], default=None)
            lines += ("; no single crossover is within noise of the best either (the closest: "
                      f"{best.text()})" if best is not None else
                      "; no pair of methods crosses (each faster beyond noise on one side only)")
        return lines

    def to_json(self) -> dict[str, Any]:
        return {"counts": self.counts, "single": self.single,
                "single_envelope": None if self.single_envelope is None else self.single_envelope.to_json(),
                "crossover": None if self.crossover is None else self.crossover.to_json(), "text": self.text()}


def split(results: Sequence[Result], counts: Sequence[int], single: str | None) -> Split:
    """Does one crossover (``small`` up to N tokens, ``large`` above) beat the single method ``single``?

    Only when ``single`` is not within noise of the best at every count (:func:`envelope`): then
    every ordered pair of passing methods whose per-count verdicts (:func:`at_tokens`, the ranking's
    noise rule) put ``small`` ahead beyond noise only below ``large``'s wins is a candidate. Its
    bound N lies between the last count ``small`` wins at and the first ``large`` wins at (counts
    where they tie within noise: either side is as good); the lower middle of that range is
    taken, a fixed function of the verdicts. The candidate whose envelope passes with the smallest
    worst median ratio is the crossover (then the bound, then the names, decide a tie); none passes:
    no crossover, said.
    """
    counts = sorted(set(counts))
    if single is None:
        return Split(counts, None, None)
    usable = [r for r in results if r.ok and all(r.ms.get(t) for t in counts)]
    if single not in {r.method for r in usable}:
        return Split(counts, single, None)
    single_env = envelope(usable, {t: single for t in counts})
    found = Split(counts, single, single_env)
    if single_env.ok:
        return found
    for a, b in itertools.permutations(sorted(usable, key=lambda r: r.method), 2):
        verdicts = {t: at_tokens(a, b, t) for t in counts}
        a_wins = [t for t, c in verdicts.items() if c.apart and c.ratio < 1.0]
        b_wins = [t for t, c in verdicts.items() if c.apart and c.ratio > 1.0]
        if not a_wins or not b_wins or max(a_wins) >= min(b_wins):
            continue
        bounds = [t for t in counts if max(a_wins) <= t < min(b_wins)]
        n = bounds[(len(bounds) - 1) // 2]
        env = envelope(usable, {t: a.method if t <= n else b.method for t in counts})
        found.candidates.append(Crossover(n, a.method, b.method, a_wins, b_wins, env))
    passing = [c for c in found.candidates if c.envelope.ok]
    if passing:
        found.crossover = min(passing, key=lambda c: (round(c.envelope.worst[1], 3), c.tokens, c.small, c.large))
    return found


def _tok(t: int) -> str:
    return f"{t} token{'s' if t != 1 else ''}"


def _counts(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in sorted(values)) + (" tokens" if list(values) != [1] else " token")
