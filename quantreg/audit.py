"""The audit trail: ``QUANTREG_DECISIONS=FILE.jsonl`` gets one JSON line per decided key and process.

Why a file of lines: a running server's choices must be checkable by scripts (``jq``, ``grep``)
after the fact, from every vLLM process (driver, EngineCore, each Worker), without a socket or a
lock. Each line is written with ONE ``os.write`` on a descriptor opened with
``O_APPEND | O_CREAT``: POSIX makes every such write land at the end of the file as a unit, so
lines from several processes never interleave (a local file system; NFS does not promise it).
A line is small (well under ``PIPE_BUF`` and any page), so a short write is not expected; one is
reported, never retried, because a retry would no longer be atomic.

Recording must never take a server down: any failure (unwritable path, full disk) becomes one
WARNING on ``vllm.quantreg.audit`` per process and the trail is off for that process.

:func:`summarise` reads a trail back for ``quantreg doctor --decisions FILE``: which method each
process chose per key, and which processes disagree (same key, different method or table
fingerprint). A last line cut short by a process killed mid-write (or still being written) is
reported, not fatal.

This module imports neither vLLM nor torch.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from . import jsonread, records, settings
from .files import ReadRefused, WriteRefused, append_regular, read_regular
from .host import host_facts
from .problems import printable, quantreg_logger

if TYPE_CHECKING:
    from .decision import Decision

logger = quantreg_logger("vllm.quantreg.audit")

#: Fields every line carries, in this order (scripts may rely on them).
FIELDS = ("time", "pid", "role", "key", "method", "rule", "layers", "strict", "fingerprint", "fallback", "host")

MAX_TRAIL_BYTES = 1 << 30
"""Largest trail appended to or read back (a line is ~300 bytes: millions of decisions)."""
LINE_DEPTH = 8
"""Deepest nesting of a trail line (quantreg writes 2; a verify line 3)."""

_lock = threading.Lock()
_warned: set[str] = set()


def decisions_path(env: Mapping[str, str] | None = None) -> str | None:
    """The trail's path from ``QUANTREG_DECISIONS``, or ``None`` when auditing is off."""
    value = settings.value(settings.DECISIONS, env)
    return str(value) if value else None


def utc_time(now: float | None = None) -> str:
    """The trail's one time format: ISO-8601 UTC with milliseconds (``2026-12-01T21:55:00.123Z``)."""
    stamp = datetime.fromtimestamp(time.time() if now is None else now, timezone.utc)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def read_time(value: Any) -> str:
    """A trail line's ``time`` as :func:`utc_time` text; old trails wrote a Unix float (read too)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        try:
            return utc_time(float(value))
        except (OverflowError, OSError, ValueError):
            return str(value)
    return str(value) if value is not None else ""


def encode_line(record: Mapping[str, Any]) -> bytes:
    """One trail line: ASCII, ``\n``-terminated, strict JSON (non-finite floats as ``"NaN"``/``"Infinity"``,
    :func:`quantreg.jsonread.dumps_strict`), so ``jq`` and :func:`summarise` read every line."""
    return (jsonread.dumps_strict(dict(record)) + "\n").encode("ascii")


def line_for(
    decision: Decision, *, role: str, layer_count: int, strict: bool, fingerprint: str,
    now: float | None = None,
) -> bytes:
    """One trail line (JSON + ``\\n``) for ``decision``; kept separate so tests can read it."""
    record = {
        "time": utc_time(now),
        "pid": os.getpid(),
        "role": role,
        "key": decision.key.as_json(),
        "method": decision.method,
        "rule": decision.source if decision.rule is not None else None,
        "layers": int(layer_count),
        "strict": bool(strict),
        "fingerprint": fingerprint,
        "fallback": decision.fallback,
        # chains are host-aware: the facts that decided (another host may decide otherwise)
        "host": dict(decision.host) if decision.host is not None else host_facts().as_json(),
    }
    if decision.stale:  # the tuned rule decided on evidence this process does not match (quantreg.pins)
        record["stale"] = list(decision.stale)
    if decision.split:  # tokens: rules decided the key per forward token count (the first side is above)
        record["split"] = [{"tokens": str(s.tokens), "method": s.decision.method,
                            "rule": s.decision.source if s.decision.rule is not None else None,
                            "fallback": s.decision.fallback} for s in decision.split]
    return encode_line(record)


def record(
    decision: Decision,
    *,
    role: str | None = None,
    layer_count: int = 1,
    strict: bool = False,
    fingerprint: str = "",
    path: str | os.PathLike[str] | None = None,
) -> bool:
    """Append one line for ``decision`` to the trail; ``True`` if it was written.

    ``path`` defaults to ``QUANTREG_DECISIONS`` (nothing happens when that is unset). ``role``
    defaults to the multiprocessing process name (inside vLLM the caller passes vLLM's own,
    :func:`quantreg.vllm.startup.process_role`). Never raises: a failure is one WARNING per path and process.
    """
    try:
        target = os.fspath(path) if path is not None else decisions_path()
        if not target:
            return False
        data = line_for(decision, role=role if role is not None else multiprocessing.current_process().name,
                        layer_count=layer_count, strict=strict, fingerprint=fingerprint)
        return _append(target, data)
    except Exception as exc:  # recording is best effort by contract
        _warn_once(str(path), f"{type(exc).__name__}: {exc}")
        return False


def append_record(record: Mapping[str, Any], path: str | os.PathLike[str] | None = None) -> bool:
    """Append any other event (e.g. a ``verify:`` comparison, ``"event": "verify"``) as one line.

    Same file and same one-write rule as :func:`record`; :func:`summarise` counts such lines apart
    from decisions. Never raises.
    """
    try:
        target = os.fspath(path) if path is not None else decisions_path()
        if not target:
            return False
        return _append(target, encode_line(record))
    except Exception as exc:  # best effort, like record()
        _warn_once(str(path), f"{type(exc).__name__}: {exc}")
        return False


def _append(target: str, data: bytes) -> bool:
    """One bounded, non-blocking append (:func:`quantreg.files.append_regular`); a refusal warns once."""
    with _lock:  # threads of one process share the descriptor table, not the line
        try:
            append_regular(target, data, MAX_TRAIL_BYTES)
        except WriteRefused as exc:
            _warn_once(target, str(exc))
            return False
    return True


def _warn_once(target: str, why: str) -> None:
    if target in _warned:
        return
    _warned.add(target)
    # printable: the path comes from the environment; a newline in it would forge a second log line
    logger.warning("quantreg: decisions trail %s (%s) is not recorded by pid %d: %s",
                   printable(target), settings.DECISIONS, os.getpid(), printable(why))


# -- reading a trail back -------------------------------------------------------------------

@dataclass
class Choice:
    """What one process chose for one key."""

    pid: int
    role: str
    method: str
    rule: str | None
    fingerprint: str
    layers: int
    strict: bool
    time: str
    decided: str = ""
    """Every side's method (``m1 for tokens<=32, m2 for tokens>32``, :func:`quantreg.decision.sides_text`),
    or ``method`` when the key is not split: what two processes are compared by."""

    def __post_init__(self) -> None:
        self.decided = self.decided or self.method

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class VerifiedLayer:
    """The ``verify`` lines of one layer (prefix, method, against): what ``doctor`` prints per layer."""

    prefix: str
    method: str
    against: str
    tolerance: float | None = None
    calls: int = 0
    exceedances: int = 0
    worst: float | None = None
    pids: set[int] = field(default_factory=set)

    def add(self, item: Mapping[str, Any]) -> None:
        self.calls += 1
        error = _number(item.get("error"))
        tolerance = _number(item.get("tolerance"))
        if tolerance is not None:
            self.tolerance = tolerance
        if item.get("ok") is False:
            self.exceedances += 1
        if error is not None and math.isnan(error):
            error = math.inf  # an error that cannot be measured is the worst there is
        if error is not None and (self.worst is None or error > self.worst):
            self.worst = error
        pid = item.get("pid")
        if isinstance(pid, int):
            self.pids.add(pid)

    def to_json(self) -> dict[str, Any]:
        data = {"prefix": self.prefix, "method": self.method, "against": self.against, "calls": self.calls,
                "exceedances": self.exceedances, "worst_error": self.worst, "tolerance": self.tolerance,
                "processes": len(self.pids)}
        return {k: jsonread.finite(v) for k, v in data.items()}

    def render(self) -> str:
        verdict = f"{self.exceedances} EXCEED" if self.exceedances else "all within"
        return (f"  verify {printable(self.prefix)}: {printable(self.method)} vs {printable(self.against)}: "
                f"{self.calls} call(s), {verdict}, worst error {_g(self.worst)}, tolerance {_g(self.tolerance)}")


def _number(value: Any) -> float | None:
    """A float from a trail value (``"Infinity"``/``"NaN"`` as :func:`encode_line` writes them;
    ``"inf"``/``"nan"`` accepted too)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value in ("inf", "-inf", "nan", "Infinity", "-Infinity", "NaN"):
        return float(value)
    return None


def _g(value: float | None) -> str:
    """A float for the terminal: 4 significant digits."""
    return "?" if value is None else f"{value:.4g}"


@dataclass
class Summary:
    """The trail per key, the disagreements found, and lines that could not be read."""

    path: str
    lines: int = 0
    keys: dict[str, list[Choice]] = field(default_factory=dict)
    disagreements: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    events: dict[str, int] = field(default_factory=dict)  # other lines by "event" (verify: comparisons)
    verified: dict[tuple[str, str, str], VerifiedLayer] = field(default_factory=dict)
    readable: bool = True
    """False when the file itself could not be read (missing, a directory, too big): nothing was summarised."""

    @property
    def exceedances(self) -> int:
        return sum(v.exceedances for v in self.verified.values())

    @property
    def ok(self) -> bool:
        return not self.disagreements and not self.problems and not self.exceedances

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "lines": self.lines,
            "processes": len({c.pid for cs in self.keys.values() for c in cs}),
            "keys": {k: [c.to_json() for c in cs] for k, cs in self.keys.items()},
            "disagreements": list(self.disagreements),
            "problems": list(self.problems),
            "events": dict(self.events),
            "verified": [v.to_json() for v in self.verified.values()],
            "exceedances": self.exceedances,
            "ok": self.ok,
        }

    def render(self) -> str:
        procs = len({c.pid for cs in self.keys.values() for c in cs})
        out = [f"decisions {printable(self.path)}: {self.lines} line(s), {len(self.keys)} key(s), "
               f"{procs} process(es)"]
        for key, choices in self.keys.items():
            out.append(f"  {printable(key)}")
            for c in choices:
                out.append(f"    {printable(c.decided):<18} {printable(c.role)} pid {c.pid}  "
                           f"[{printable(c.rule or 'no rule')}]  layers {c.layers}  fingerprint "
                           f"{printable(c.fingerprint)}  {printable(c.time)}{'  strict' if c.strict else ''}")
        out += [v.render() for v in self.verified.values()]
        out += [f"DISAGREE: {printable(d)}" for d in self.disagreements]
        out += [f"warning: {printable(p)}" for p in self.problems]
        if self.exceedances:
            out.append(f"VERIFY: {self.exceedances} comparison(s) exceeded their tolerance")
        if self.ok:
            out.append("all processes agree")
        return "\n".join(out)


def _decided(item: Mapping[str, Any]) -> str:
    """A decision line's value compared between processes: every side of its ``split`` (as
    :func:`line_for` writes it), else its ``method``. A ``split`` not in that form is a bad line."""
    split = item.get("split")
    if split is None:
        return str(item["method"])
    if not isinstance(split, list) or not split or not all(
            isinstance(s, dict) and isinstance(s.get("method"), str) and isinstance(s.get("tokens"), str)
            for s in split):
        raise ValueError("split: expected a list of {tokens, method} as quantreg writes it")
    from .decision import sides_text

    return sides_text([(s["method"], s["tokens"]) for s in split])


def _key_text(raw: Any) -> str:
    if isinstance(raw, dict):
        # the layer kind only when the trail names one (dense layers, issue 30): an experts key reads as before
        layer = f", layer {raw.get('layer')}" if raw.get("layer") not in (None, "experts") else ""
        return f"({raw.get('quant_format')}, {raw.get('model_type')}, {raw.get('device')}){layer}"
    return str(raw)


DECISION_FIELDS = (
    records.Field("pid", (int,)), records.Field("method", (str,), limit=200),
    records.Field("key", (dict, str)), records.Field("role", (str,), required=False),
    records.Field("rule", (str, type(None)), required=False, limit=1000),
    records.Field("fingerprint", (str,), required=False, limit=200), records.Field("layers", (int,), required=False),
    records.Field("strict", (bool,), required=False),
    records.Field("time", (str, int, float), required=False, limit=80),
)
"""A decision line's fields as :func:`line_for` writes them, checked before any is shown (:mod:`quantreg.records`)."""


def summarise(path: str | os.PathLike[str]) -> Summary:
    """Read a trail: per key, each process's choice; flag keys whose processes disagree.

    A process that recorded the same key several times (e.g. a growing layer count) is shown
    once, with its last line. Unreadable lines are problems naming their line number; a last
    line without its newline is reported as cut short (a writer killed mid-line or still busy).
    """
    where = os.fspath(path)
    summary = Summary(where)
    try:
        data = read_regular(where, MAX_TRAIL_BYTES, expected="a JSONL trail", noun="a trail")
    except ReadRefused as exc:
        summary.problems.append(f"{printable(where)}: cannot read: {exc}")
        summary.readable = False
        return summary
    raw_lines = data.split(b"\n")
    complete = data.endswith(b"\n") or not data
    if raw_lines and raw_lines[-1] == b"":
        raw_lines.pop()
    per_key: dict[str, dict[int, Choice]] = {}
    summary.lines = len(raw_lines)
    for number, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        last = number == len(raw_lines)
        try:
            item = jsonread.loads(raw, max_depth=LINE_DEPTH)
            if not isinstance(item, dict):
                raise ValueError("not a JSON object")
            if item.get("event") is not None:  # e.g. a verify: comparison; not a decision
                summary.events[str(item["event"])] = summary.events.get(str(item["event"]), 0) + 1
                if item.get("event") == "verify":
                    layer = (str(item.get("prefix")), str(item.get("method")), str(item.get("against")))
                    summary.verified.setdefault(layer, VerifiedLayer(*layer)).add(item)
                continue
            records.check(item, DECISION_FIELDS, f"{where}:{number}")  # types first: no str() of a list
            choice = Choice(int(item["pid"]), str(item.get("role", "?")), str(item["method"]),
                            item.get("rule"), str(item.get("fingerprint", "")), int(item.get("layers", 0)),
                            bool(item.get("strict", False)), read_time(item.get("time")), _decided(item))
            key = _key_text(item["key"])
        except (ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, records.RecordFault) and (complete or not last):
                summary.problems.append(str(exc))
            elif last and not complete:
                summary.problems.append(f"{where}:{number}: last line is cut short (a writer was stopped "
                                        "mid-line or is still writing); ignored")
            else:
                summary.problems.append(f"{where}:{number}: not a decision line ({exc})")
            continue
        per_key.setdefault(key, {})[choice.pid] = choice
    for key, by_pid in per_key.items():
        choices = sorted(by_pid.values(), key=lambda c: c.pid)
        summary.keys[key] = choices
        methods = sorted({c.decided for c in choices})  # every side of a split, not only the first
        prints = sorted({c.fingerprint for c in choices})
        if len(methods) > 1:
            who = "; ".join(f"{m}: " + ", ".join(f"{c.role} pid {c.pid}" for c in choices if c.decided == m)
                            for m in methods)
            summary.disagreements.append(f"{key}: processes chose different methods ({who})")
        if len(prints) > 1:
            who = "; ".join(f"{p}: " + ", ".join(f"{c.role} pid {c.pid}" for c in choices if c.fingerprint == p)
                            for p in prints)
            summary.disagreements.append(f"{key}: processes decided from different tables (fingerprints {who})")
    # Every value here came from the file: escaped, so a trail cannot forge a line or drive the terminal.
    summary.problems = [printable(x) for x in summary.problems]
    summary.disagreements = [printable(x) for x in summary.disagreements]
    return summary
