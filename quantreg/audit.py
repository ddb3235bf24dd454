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

import json
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .host import host_facts

if TYPE_CHECKING:
    from .decision import Decision

logger = logging.getLogger("vllm.quantreg.audit")

DECISIONS_ENV = "QUANTREG_DECISIONS"
#: Fields every line carries, in this order (scripts may rely on them).
FIELDS = ("time", "pid", "role", "key", "method", "rule", "layers", "strict", "fingerprint", "fallback", "host")

_lock = threading.Lock()
_warned: set[str] = set()


def process_role() -> str:
    """The vLLM process role, as vLLM's own log prefix names it: ``EngineCore``, ``Worker_TP1``, ...

    Cheap and import-free: vLLM 0.32 keeps the name it prints in each log line in
    ``vllm.logger._vllm_process_info`` (set by ``decorate_logs`` in ``v1/engine/core.py``
    ``run_engine_core`` as ``EngineCore`` / ``EngineCore_DP<n>`` and in
    ``v1/executor/multiproc_executor.py`` ``setup_proc_title_and_log_prefix`` as
    ``Worker[_DP<n>][_PP<n>][_TP<n>][_EP<n>]``), paired with the pid that set it so a forked child
    does not inherit its parent's name. Only a module vLLM already imported is read; otherwise
    the multiprocessing process name (``MainProcess`` in the driver) stands in.
    """
    vllm_logger = sys.modules.get("vllm.logger")
    info = getattr(vllm_logger, "_vllm_process_info", None) if vllm_logger is not None else None
    if isinstance(info, tuple) and len(info) == 2 and info[1] == os.getpid():
        return str(info[0])
    return multiprocessing.current_process().name


def decisions_path(env: Mapping[str, str] | None = None) -> str | None:
    """The trail's path from ``QUANTREG_DECISIONS``, or ``None`` when auditing is off."""
    value = (os.environ if env is None else env).get(DECISIONS_ENV, "").strip()
    return value or None


def line_for(
    decision: Decision, *, role: str, layer_count: int, strict: bool, fingerprint: str,
    now: float | None = None,
) -> bytes:
    """One trail line (JSON + ``\\n``) for ``decision``; kept separate so tests can read it."""
    stamp = datetime.fromtimestamp(time.time() if now is None else now, timezone.utc)
    record = {
        "time": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "pid": os.getpid(),
        "role": role,
        "key": dict(decision.key._asdict()),
        "method": decision.method,
        "rule": decision.source if decision.rule is not None else None,
        "layers": int(layer_count),
        "strict": bool(strict),
        "fingerprint": fingerprint,
        "fallback": decision.fallback,
        # chains are host-aware: the facts that decided (another host may decide otherwise)
        "host": dict(decision.host) if decision.host is not None else host_facts().as_json(),
    }
    # ensure_ascii: one byte per character outside strings' escapes, so no multi-byte surprises.
    return (json.dumps(record, ensure_ascii=True, separators=(",", ":")) + "\n").encode("ascii")


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
    defaults to :func:`process_role`. Never raises: a failure is one WARNING per path and process.
    """
    try:
        target = os.fspath(path) if path is not None else decisions_path()
        if not target:
            return False
        data = line_for(decision, role=role if role is not None else process_role(),
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
        data = (json.dumps(dict(record), ensure_ascii=True, separators=(",", ":"), default=str) + "\n").encode("ascii")
        return _append(target, data)
    except Exception as exc:  # best effort, like record()
        _warn_once(str(path), f"{type(exc).__name__}: {exc}")
        return False


def _append(target: str, data: bytes) -> bool:
    with _lock:  # threads of one process share the descriptor table, not the line
        try:
            fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            _warn_once(target, f"cannot open: {exc.strerror or exc}")
            return False
        try:
            written = os.write(fd, data)
        except OSError as exc:
            _warn_once(target, f"cannot write: {exc.strerror or exc}")
            return False
        finally:
            os.close(fd)
    if written != len(data):
        _warn_once(target, f"short write ({written} of {len(data)} bytes); the last line is cut")
        return False
    return True


def _warn_once(target: str, why: str) -> None:
    if target in _warned:
        return
    _warned.add(target)
    logger.warning("quantreg: decisions trail %s (%s) is not recorded by pid %d: %s",
                   target, DECISIONS_ENV, os.getpid(), why)


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

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Summary:
    """The trail per key, the disagreements found, and lines that could not be read."""

    path: str
    lines: int = 0
    keys: dict[str, list[Choice]] = field(default_factory=dict)
    disagreements: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    events: dict[str, int] = field(default_factory=dict)  # other lines by "event" (verify: comparisons)

    @property
    def ok(self) -> bool:
        return not self.disagreements and not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "lines": self.lines,
            "processes": len({c.pid for cs in self.keys.values() for c in cs}),
            "keys": {k: [c.to_json() for c in cs] for k, cs in self.keys.items()},
            "disagreements": list(self.disagreements),
            "problems": list(self.problems),
            "events": dict(self.events),
            "ok": self.ok,
        }

    def render(self) -> str:
        procs = len({c.pid for cs in self.keys.values() for c in cs})
        out = [f"decisions {self.path}: {self.lines} line(s), {len(self.keys)} key(s), {procs} process(es)"]
        for key, choices in self.keys.items():
            out.append(f"  {key}")
            for c in choices:
                out.append(f"    {c.method:<18} {c.role} pid {c.pid}  [{c.rule or 'no rule'}]  "
                           f"layers {c.layers}  fingerprint {c.fingerprint}{'  strict' if c.strict else ''}")
        out += [f"DISAGREE: {d}" for d in self.disagreements]
        out += [f"warning: {p}" for p in self.problems]
        if self.ok:
            out.append("all processes agree")
        return "\n".join(out)


def _key_text(raw: Any) -> str:
    if isinstance(raw, dict):
        return f"({raw.get('quant_format')}, {raw.get('model_type')}, {raw.get('device')})"
    return str(raw)


def summarise(path: str | os.PathLike[str]) -> Summary:
    """Read a trail: per key, each process's choice; flag keys whose processes disagree.

    A process that recorded the same key several times (e.g. a growing layer count) is shown
    once, with its last line. Unreadable lines are problems naming their line number; a last
    line without its newline is reported as cut short (a writer killed mid-line or still busy).
    """
    where = os.fspath(path)
    summary = Summary(where)
    try:
        data = Path(where).read_bytes()
    except OSError as exc:
        summary.problems.append(f"{where}: cannot read: {exc.strerror or exc}")
        return summary
    raw_lines = data.split(b"\n")
    complete = data.endswith(b"\n") or not data
    if raw_lines and raw_lines[-1] == b"":
        raw_lines.pop()
    per_key: dict[str, dict[int, Choice]] = {}
    for number, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        last = number == len(raw_lines)
        try:
            item = json.loads(raw)
            if not isinstance(item, dict):
                raise ValueError("not a JSON object")
            if item.get("event") is not None:  # e.g. a verify: comparison; not a decision
                summary.events[str(item["event"])] = summary.events.get(str(item["event"]), 0) + 1
                if item.get("event") == "verify" and item.get("ok") is False:
                    summary.problems.append(f"{where}:{number}: verify: {item.get('prefix')} {item.get('method')} "
                                            f"vs {item.get('against')}: error {item.get('error')} exceeds "
                                            f"tolerance {item.get('tolerance')}")
                continue
            choice = Choice(int(item["pid"]), str(item.get("role", "?")), str(item["method"]),
                            item.get("rule"), str(item.get("fingerprint", "")), int(item.get("layers", 0)),
                            bool(item.get("strict", False)), str(item.get("time", "")))
            key = _key_text(item["key"])
        except (ValueError, KeyError, TypeError) as exc:
            if last and not complete:
                summary.problems.append(f"{where}:{number}: last line is cut short (a writer was stopped "
                                        "mid-line or is still writing); ignored")
            else:
                summary.problems.append(f"{where}:{number}: not a decision line ({exc})")
            continue
        summary.lines += 1
        per_key.setdefault(key, {})[choice.pid] = choice
    for key, by_pid in per_key.items():
        choices = sorted(by_pid.values(), key=lambda c: c.pid)
        summary.keys[key] = choices
        methods = sorted({c.method for c in choices})
        prints = sorted({c.fingerprint for c in choices})
        if len(methods) > 1:
            who = "; ".join(f"{m}: " + ", ".join(f"{c.role} pid {c.pid}" for c in choices if c.method == m)
                            for m in methods)
            summary.disagreements.append(f"{key}: processes chose different methods ({who})")
        if len(prints) > 1:
            who = "; ".join(f"{p}: " + ", ".join(f"{c.role} pid {c.pid}" for c in choices if c.fingerprint == p)
                            for p in prints)
            summary.disagreements.append(f"{key}: processes decided from different tables (fingerprints {who})")
    return summary
