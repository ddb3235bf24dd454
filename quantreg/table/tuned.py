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

from ..bounds import MAX_COUNT, MAX_SIZE, number_problem, shown, text_count, whole_problem
from ..methods import valid_name
from ..problems import did_you_mean, printable, type_name
from .located import mapping_key_lines

TUNED_KEYS = ("at", "host", "vllm", "torch", "phase_weights", "tolerance", "budget_s", "rounds", "shape", "results",
              "ranking", "load_avg", "pins", "crossover")
CROSSOVER_KEYS = ("tokens", "small", "large", "worst_ratio", "worst_at")
"""``tuned.crossover`` on each rule of a measured pair: the bound, who serves each side, and the
envelope's worst median ratio to the fastest method (and where): the crossover as data, beside
``tuned.ranking``'s sentence, so a tool can read where tune split without parsing prose."""
RESULT_KEYS = ("method", "ok", "error", "ms", "score_ms", "rel_error", "spread", "warnings")
PIN_KEYS = ("cpu_model", "cpu_flags", "bandwidth_gbs", "vllm", "torch", "quantreg", "plugins", "kernels", "shape")
"""``tuned.pins``' fields (:mod:`quantreg.pins` compares each with the running process)."""
SHAPE_KEYS = ("experts", "hidden", "intermediate", "top_k", "heads", "kv_heads", "head_dim", "vocab")
"""Layer sizes a shape (``tuned.shape``, ``tuned.pins.shape``) may name (:data:`quantreg.pins.SHAPE_FIELDS`)."""
HOST_KEYS = ("machine", "kind", "vendor", "model", "cores", "flags", "simulated")
"""``tuned.host``: :meth:`quantreg.host.HostFacts.as_json`."""

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
        """One line for ``explain``: who won against whom, at the first measured token count.

        Total: the evidence was checked when the table was read (:func:`parse_tuned`), and a value that
        still cannot be shown (a rule built by hand in code) reads as unreadable evidence, never an exception.
        """
        try:
            return self._summary(chosen)
        except Exception as exc:
            return printable(f"tuned evidence unreadable ({type(exc).__name__}); re-run quantreg tune")

    def _summary(self, chosen: str | None) -> str:
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
    for k in ("tokens", "worst_at"):
        if k in value and whole_problem(value[k]):
            return f"{k}: {whole_problem(value[k], what='a token count')}"
    for side in ("small", "large"):
        if not valid_name(value[side]):
            return f"{side}: expected a method name, got {shown(value[side])}"
    if "worst_ratio" in value and number_problem(value["worst_ratio"], 0, 1e9, low_open=True):
        return f"worst_ratio: {number_problem(value['worst_ratio'], 0, 1e9, 'a positive number', low_open=True)}"
    return None


def _flag_list_problem(value: Any, what: str) -> str | None:
    if isinstance(value, list) and all(isinstance(f, str) and f and len(f) <= 64 and not any(c.isspace() for c in f)
                                       for f in value):
        return None
    if isinstance(value, list):  # name the item that is not a flag name, not just "got list"
        for i, f in enumerate(value):
            if not (isinstance(f, str) and f and len(f) <= 64 and not any(c.isspace() for c in f)):
                why = ("a flag name has no spaces and at most 64 characters" if isinstance(f, str)
                       else "expected a string")
                return (f"item {i + 1} ({shown(f)}) is not one of the {what}: {why}; write them as a list "
                        "such as [avx2, fma]")
    if isinstance(value, str):  # read letter by letter it would be [a, v, x, 2]
        return (f"expected a list of {what} such as [avx2, fma], got {shown(value)} (write it as a list: "
                f"[{printable(value[:40])}])")
    return f"expected a list of {what} such as [avx2, fma], got {shown(value)}"


def _optional_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return None
    return f"expected a version string (or null: not installed), got {shown(value)}"


def shape_problems(value: Any, extra: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(sub-key, message) for every field of a shape mapping (``{experts: 32, hidden: 2880, ...}``) that is not
    a size from 1 to :data:`quantreg.bounds.MAX_SIZE`; ``extra`` names text fields allowed beside them."""
    if not isinstance(value, dict):
        return [("", f"expected a mapping of layer sizes such as {{experts: 32, hidden: 2880}}, got {shown(value)}")]
    found: list[tuple[str, str]] = []
    for k, v in value.items():
        if k in extra:
            if not isinstance(v, str):
                found.append((str(k), f"expected a string, got {shown(v)}"))
        elif k not in SHAPE_KEYS:
            found.append((str(k), f"unknown key{did_you_mean(str(k), (*SHAPE_KEYS, *extra))} "
                                  f"(expected one of: {', '.join((*SHAPE_KEYS, *extra))})"))
        else:
            problem = whole_problem(v, 1, MAX_SIZE, "a size")
            if problem:
                found.append((str(k), problem))
    return found


def _mapping_problem(value: Any, key_ok: Callable[[Any], bool], value_ok: Callable[[Any], bool],
                     expected: str) -> str | None:
    if isinstance(value, dict):
        bad = next(((k, v) for k, v in value.items() if not (key_ok(k) and value_ok(v))), None)
        if bad is None:
            return None
        return f"expected {expected}; {printable(str(bad[0]))[:60]!r}: {shown(bad[1])}"
    return f"expected {expected}, got {shown(value)}"


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


PIN_CHECKS: Mapping[str, Callable[[Any], str | None]] = {
    "cpu_model": lambda v: None if isinstance(v, str) else f"expected a CPU model name (a string), got {shown(v)}",
    "cpu_flags": lambda v: _flag_list_problem(v, "CPU flag names"),
    "bandwidth_gbs": lambda v: number_problem(v, 0, 1e6, "a bandwidth in GB/s", low_open=True),
    "vllm": _optional_text,
    "torch": _optional_text,
    "quantreg": _optional_text,
    "plugins": lambda v: _mapping_problem(v, lambda k: isinstance(k, str) and bool(k),
                                          lambda x: x is None or isinstance(x, str),
                                          "a mapping of distribution -> version, such as {quantreg-cpu-mxfp4: 0.1.0}"),
    "kernels": lambda v: _mapping_problem(v, valid_name, _is_sha256,
                                          "a mapping of method -> sha256 (64 lower-case hex digits)"),
    "shape": lambda v: "; ".join(f"{k}: {m}" if k else m for k, m in shape_problems(v)) or None,
}
"""One check per ``tuned.pins`` field: the table reader (:func:`parse_tuned`) and every reader of the evidence
(:func:`quantreg.pins.stale_pins`) ask the same question, so a value the reader would refuse is never compared."""


def pin_problems(pins: Any) -> list[tuple[str, str]]:
    """(field, message) for every field of a ``tuned.pins`` mapping that is not what ``quantreg tune`` writes."""
    if not isinstance(pins, dict):
        return [("", f"expected a mapping of field -> recorded value, got {shown(pins)}")]
    found: list[tuple[str, str]] = []
    for k, v in pins.items():
        check = PIN_CHECKS.get(k) if isinstance(k, str) else None
        if check is None:
            found.append((printable(str(k))[:60], f"unknown pinned field{did_you_mean(str(k), PIN_KEYS)} "
                                                  f"(expected one of: {', '.join(PIN_KEYS)})"))
            continue
        problem = check(v)
        if problem:
            found.append((k, problem))
    return found


def host_problems(value: Any) -> list[tuple[str, str]]:
    """(field, message) for ``tuned.host`` (:meth:`quantreg.host.HostFacts.as_json` as tune recorded it)."""
    if not isinstance(value, dict):
        return [("", f"expected a mapping (kind, cores, flags, ...), got {shown(value)}")]
    found: list[tuple[str, str]] = []
    for k, v in value.items():
        if k not in HOST_KEYS:
            found.append((printable(str(k))[:60],
                          f"unknown key{did_you_mean(str(k), HOST_KEYS)} (expected one of: {', '.join(HOST_KEYS)})"))
        elif k == "cores":
            problem = whole_problem(v, 1, MAX_SIZE, "a core count")
            if problem:
                found.append((k, problem))
        elif k == "flags":
            problem = _flag_list_problem(v, "CPU flag names")
            if problem:
                found.append((k, problem))
        elif k == "simulated":
            if not isinstance(v, bool):
                found.append((k, f"expected true or false, got {shown(v)}"))
        elif not isinstance(v, str):
            found.append((k, f"expected a string, got {shown(v)}"))
    return found


def _ms(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3g} ms" if value < 100 else f"{value:.0f} ms"


def _is_number(value: object) -> bool:
    """A finite int or float (bool excluded); an int too large for a float is not one (never OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return abs(value) <= 2**63 if isinstance(value, int) else math.isfinite(value)


def _token_key(key: object) -> int | None:
    """``1`` or ``"1"`` -> 1 (a token count from 1 to :data:`quantreg.bounds.MAX_COUNT`); anything else -> None."""
    if isinstance(key, int) and not isinstance(key, bool) and 0 < key <= MAX_COUNT:
        return key
    if isinstance(key, str):
        return text_count(key)  # ASCII digits only ("²" passes isdigit, not int()); never 5,000 of them
    return None


def parse_tuned(raw: Any, where: str, line: int, fail: Fail) -> TunedEvidence | None:
    """Check a rule's ``tuned:`` mapping; every fault goes to ``fail(line, key, message)``."""
    key_lines = mapping_key_lines(raw, where, line, fail,
                                  "a mapping written by 'quantreg tune' (at, host, results, ...)")
    if key_lines is None:
        return None
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
    def nested(k: str, found: list[tuple[str, str]]) -> None:
        """Each problem of the mapping at ``k``, located at its own key's line (else ``k``'s)."""
        lines: dict[Any, int] = getattr(raw[k], "key_lines", {})
        for sub, message in found:
            bad(f"{k}.{sub}" if sub else k, message, lines.get(sub, key_lines.get(k, line)) if sub else None)

    if "host" in raw:
        nested("host", host_problems(raw["host"]))
    if "shape" in raw:  # a dense rule's names its weights too ("layer 0", "synthetic", "lm_head")
        nested("shape", shape_problems(raw["shape"], extra=("weights",)))
    if "pins" in raw:
        nested("pins", pin_problems(raw["pins"]))
    if "rounds" in raw:
        problem = whole_problem(raw["rounds"], 0, MAX_COUNT)
        if problem:
            bad("rounds", problem)
    for k in ("tolerance", "budget_s"):
        if k in raw:
            problem = number_problem(raw[k], 0, 1e9, "a positive number", low_open=True)
            if problem:
                bad(k, problem)
    for k in ("ranking",):
        if k in raw and not (isinstance(raw[k], list) and all(isinstance(v, str) for v in raw[k])):
            bad(k, f"expected a list of strings, got {type_name(raw[k])}")
    if "load_avg" in raw and not (isinstance(raw["load_avg"], list) and all(_is_number(v) for v in raw["load_avg"])):
        bad("load_avg", f"expected a list of numbers (1, 5, 15 minute load averages), got {type_name(raw['load_avg'])}")
    if "crossover" in raw:
        problem = _crossover_problem(raw["crossover"])
        if problem is not None:
            bad("crossover", problem)
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
