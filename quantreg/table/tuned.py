"""``tuned:`` on a rule: the measurements ``quantreg tune`` chose its chain by (no torch, no vLLM).

Why in the table itself: a chain ordered by measurement is only trustworthy while one can see
what was measured, where and when. ``explain`` shows it ("chosen by quantreg tune on 2026-12-01
on an avx512 host: fast_method 17 ms vs slow_method 40 ms at 1 token"), and a reader of the YAML
sees the same numbers. The evidence is checked like every other rule field (located problems
naming file, line and key) but never changes a decision: the ``method:`` chain does.

Shape (every key optional except ``results``)::

    tuned:
      at: "2026-12-01T22:10:00Z"        # when tune measured
      host: {kind: avx512, cores: 2, flags: [...], ...}   # quantreg.host.HostFacts.as_json()
      vllm: "0.32.0"
      torch: "2.13.0+cpu"
      phase_weights: {"1": 0.5, "64": 0.25, "256": 0.25}  # tokens -> weight of the geometric mean
      tolerance: 0.02                   # relative error allowed against the float64 reference
      budget_s: 60
      rounds: 5                         # timing rounds measured per token count (after one warm-up)
      shape: {experts: 32, hidden: 2880, intermediate: 2880, top_k: 4}
      results:                          # every method tried, fastest passing first
        - {method: fast_method, ok: true, score_ms: 2.1, ms: {"1": 1.9, "64": 12.0, "256": 40.0}, rel_error: 0.004}
        - {method: wrong, ok: false, error: "numerics: relative error 0.61 > 0.02 at 1 token"}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..methods import valid_name
from ..problems import did_you_mean, printable, type_name

TUNED_KEYS = ("at", "host", "vllm", "torch", "phase_weights", "tolerance", "budget_s", "rounds", "shape", "results",
              "ranking", "load_avg", "pins", "crossover")
CROSSOVER_KEYS = ("tokens", "small", "large", "worst_ratio", "worst_at")
"""``tuned.crossover`` on each rule of a measured pair: the bound, who serves each side, and the
envelope's worst median ratio to the fastest method (and where): the crossover as data, beside
``tuned.ranking``'s sentence, so a tool can read where tune split without parsing prose."""
RESULT_KEYS = ("method", "ok", "error", "ms", "score_ms", "rel_error", "spread", "warnings")

Fail = Callable[[int | None, str, str], None]


@dataclass(frozen=True)
class TunedResult:
    method: str
    ok: bool
    error: str | None
    ms: Mapping[int, float | None]


@dataclass(frozen=True)
class TunedEvidence:
    """A rule's checked ``tuned:`` mapping; ``raw`` is kept as written for JSON and the fingerprint."""

    raw: Mapping[str, Any]
    results: tuple[TunedResult, ...]

    def summary(self, chosen: str | None = None) -> str:
        """One line for ``explain``: who won against whom, at the first measured token count."""
        at = str(self.raw.get("at", ""))[:10] or "an unknown date"
        host = self.raw.get("host")
        kind = host.get("kind", "?") if isinstance(host, Mapping) else "?"
        cores = host.get("cores") if isinstance(host, Mapping) else None
        where = f"an {kind} host" if str(kind)[:1] in "aeiou" else f"a {kind} host"
        if cores:
            where += f" ({cores} cores)"
        passed = [r for r in self.results if r.ok]
        tokens = min((t for r in passed for t, v in r.ms.items() if v is not None), default=None)
        text = f"chosen by quantreg tune on {at} on {where}"
        if tokens is not None:
            first = sorted(passed, key=lambda r: (r.method != chosen,))  # the chosen one first, then tune's order
            times = " vs ".join(f"{r.method} {_ms(r.ms.get(tokens))}" for r in first)
            text += f": {times} at {tokens} token{'s' if tokens != 1 else ''}"
        cross = self.raw.get("crossover")
        if isinstance(cross, Mapping):  # checked by parse_tuned
            text += (f"; measured crossover at {cross['tokens']} tokens: {cross['small']} up to it, "
                     f"{cross['large']} above")
            if "worst_ratio" in cross:
                text += f" (worst x{float(cross['worst_ratio']):.3f} of the fastest, at {cross.get('worst_at', '?')})"
        refused = [r for r in self.results if not r.ok]
        if refused:
            text += "; refused: " + "; ".join(f"{r.method} ({r.error or 'failed'})" for r in refused)
        return printable(text)  # every field here came from a table: one line, whatever a value holds


def _crossover_problem(value: Any) -> str | None:
    """Why ``tuned.crossover`` is not ``{tokens: N, small: METHOD, large: METHOD[, worst_ratio, worst_at]}``."""
    expected = "expected {tokens: N, small: METHOD, large: METHOD, worst_ratio: X, worst_at: N} as tune writes it"
    if not isinstance(value, dict):
        return f"{expected}, got {type_name(value)}"
    unknown = [str(k) for k in value if k not in CROSSOVER_KEYS]
    if unknown:
        return f"unknown key{did_you_mean(unknown[0], CROSSOVER_KEYS)} {printable(unknown[0])!r}; {expected}"
    missing = [k for k in ("tokens", "small", "large") if k not in value]
    if missing:
        return f"{', '.join(missing)} missing; {expected}"
    if _token_key(value["tokens"]) is None or isinstance(value["tokens"], str):
        return f"tokens: expected a whole number >= 1, got {type_name(value['tokens'])} {value['tokens']!r}"[:200]
    for side in ("small", "large"):
        if not valid_name(value[side]):
            return f"{side}: expected a method name, got {type_name(value[side])} {value[side]!r}"[:200]
    if "worst_ratio" in value and not (_is_number(value["worst_ratio"]) and value["worst_ratio"] > 0):
        return f"worst_ratio: expected a positive number, got {type_name(value['worst_ratio'])}"
    if "worst_at" in value and (_token_key(value["worst_at"]) is None or isinstance(value["worst_at"], str)):
        return f"worst_at: expected a whole number >= 1, got {type_name(value['worst_at'])}"
    return None


def _ms(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3g} ms" if value < 100 else f"{value:.0f} ms"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _token_key(key: object) -> int | None:
    """``1`` or ``"1"`` -> 1; anything else -> None."""
    if isinstance(key, int) and not isinstance(key, bool) and key > 0:
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit() and int(key) > 0:  # "²" passes isdigit, not int()
        return int(key)
    return None


def parse_tuned(raw: Any, where: str, line: int, fail: Fail) -> TunedEvidence | None:
    """Check a rule's ``tuned:`` mapping; every fault goes to ``fail(line, key, message)``."""
    if not isinstance(raw, dict):
        fail(line, where,
             f"expected a mapping written by 'quantreg tune' (at, host, results, ...), got {type_name(raw)}")
        return None
    key_lines: dict[Any, int] = getattr(raw, "key_lines", {})
    ok = True

    def bad(k: str, message: str, at: int | None = None) -> None:
        nonlocal ok
        ok = False
        fail(at if at is not None else key_lines.get(k, line), f"{where}.{k}", message)

    for k in raw:
        if k not in TUNED_KEYS:
            bad(str(k), f"unknown key{did_you_mean(str(k), TUNED_KEYS)} (expected one of: {', '.join(TUNED_KEYS)})")
    for k in ("at", "vllm", "torch"):
        if k in raw and raw[k] is not None and not isinstance(raw[k], str):
            bad(k, f"expected a string, got {type_name(raw[k])}")
    for k in ("host", "shape"):
        if k in raw and not isinstance(raw[k], dict):
            bad(k, f"expected a mapping, got {type_name(raw[k])}")
    if "rounds" in raw and (isinstance(raw["rounds"], bool) or not isinstance(raw["rounds"], int) or raw["rounds"] < 0):
        got = raw["rounds"]
        shown = f"{type_name(got)} {got!r}" if isinstance(got, (int, float, str)) else type_name(got)
        bad("rounds", f"expected a whole number >= 0, got {printable(shown)[:80]}")
    for k in ("tolerance", "budget_s"):
        if k in raw and not (_is_number(raw[k]) and raw[k] > 0):
            bad(k, f"expected a positive number, got {type_name(raw[k])} {raw[k]!r}"[:200])
    for k in ("ranking",):
        if k in raw and not (isinstance(raw[k], list) and all(isinstance(v, str) for v in raw[k])):
            bad(k, f"expected a list of strings, got {type_name(raw[k])}")
    if "load_avg" in raw and not (isinstance(raw["load_avg"], list) and all(_is_number(v) for v in raw["load_avg"])):
        bad("load_avg", f"expected a list of numbers (1, 5, 15 minute load averages), got {type_name(raw['load_avg'])}")
    if "crossover" in raw:
        problem = _crossover_problem(raw["crossover"])
        if problem is not None:
            bad("crossover", problem)
    if "pins" in raw and not isinstance(raw["pins"], dict):
        bad("pins", f"expected a mapping of field -> recorded value, got {type_name(raw['pins'])}")
    weights = raw.get("phase_weights")
    if weights is not None and not (isinstance(weights, dict) and weights
                                    and all(_token_key(t) and _is_number(w) and w >= 0 for t, w in weights.items())):
        bad("phase_weights", "expected a mapping of token count -> weight >= 0, such as {1: 0.5, 64: 0.25, 256: 0.25}")
    results: list[TunedResult] = []
    raw_results = raw.get("results")
    if not isinstance(raw_results, list):
        bad("results", f"expected a list of {{method, ok, ms, error}} mappings, got {type_name(raw_results)}")
        return None
    result_lines: list[int] = getattr(raw_results, "item_lines", [])
    for i, item in enumerate(raw_results):
        at_line = result_lines[i] if i < len(result_lines) else key_lines.get("results", line)
        name = f"results[{i}]"
        if not isinstance(item, dict):
            bad(name, f"expected a mapping with method and ok, got {type_name(item)}", at_line)
            continue
        unknown = [k for k in item if k not in RESULT_KEYS]
        method, passed, error, ms = item.get("method"), item.get("ok"), item.get("error"), item.get("ms") or {}
        if unknown:
            k = str(unknown[0])
            bad(f"{name}.{k}", f"unknown key{did_you_mean(k, RESULT_KEYS)} (expected one of: {', '.join(RESULT_KEYS)})",
                at_line)
        elif not valid_name(method):
            bad(f"{name}.method", f"expected a method name, got {type_name(method)} {method!r}"[:200], at_line)
        elif not isinstance(passed, bool):
            bad(f"{name}.ok", f"expected true or false, got {type_name(passed)}", at_line)
        elif error is not None and not isinstance(error, str):
            bad(f"{name}.error", f"expected a string or null, got {type_name(error)}", at_line)
        elif not isinstance(ms, dict) or not all(_token_key(t) and (v is None or (_is_number(v) and v >= 0))
                                                 for t, v in ms.items()):
            bad(f"{name}.ms", "expected a mapping of token count -> milliseconds (or null), such as {1: 1.9}", at_line)
        elif "warnings" in item and not (isinstance(item["warnings"], list)
                                         and all(isinstance(w, str) for w in item["warnings"])):
            bad(f"{name}.warnings", "expected a list of strings", at_line)
        elif "spread" in item and not (isinstance(item["spread"], dict) and all(
                _token_key(t) and _is_number(v) and v >= 0 for t, v in item["spread"].items())):
            bad(f"{name}.spread", "expected a mapping of token count -> relative spread >= 0", at_line)
        elif any(k in item and item[k] is not None and not _is_number(item[k]) for k in ("score_ms", "rel_error")):
            bad(f"{name}", "score_ms and rel_error must be numbers (or null)", at_line)
        else:
            results.append(TunedResult(method, passed, error,
                                       {_token_key(t) or 0: (None if v is None else float(v)) for t, v in ms.items()}))
    if not ok:
        return None
    return TunedEvidence(raw=_plain(raw), results=tuple(results))


def _plain(value: Any) -> Any:
    """YAML's line-remembering containers as plain dicts and lists (for JSON and the fingerprint)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
