"""Errors as values: every fault in a table or a plugin becomes a located :class:`Problem`.

Loaders collect problems instead of raising, so one run reports everything wrong at once and
the caller (CLI, vLLM seam) decides whether a problem is fatal. Nothing is half-applied: a
source with problems contributes no rules.
"""

from __future__ import annotations

import bisect
import functools
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def describe(exc: BaseException, located: bool = False) -> str:
    """An exception as one line, ``TypeName: first line of its text`` (`` ...`` when it had more).

    The one helper for this (plugin faults, the conformance kit, start-up boundaries): safe on
    exceptions whose ``__str__`` raises or is huge (cut at 300 characters). ``located`` adds
    ``(at file.py:LINE in func)`` from the innermost frame, enough to find the line without a traceback.
    """
    try:
        name = type(exc).__name__
    except Exception:  # pragma: no cover - a type without a name is beyond odd
        name = "exception"
    try:
        text = str(exc)
    except Exception:
        text = "<its message could not be read>"
    if not isinstance(text, str):  # pragma: no cover - str() always returns str
        text = ""
    lines = text.strip().splitlines()
    first = lines[0] if lines else ""
    more = len(lines) > 1 or len(first) > 300
    text = first[:300] + ("..." if len(first) > 300 else (" ..." if more else ""))
    where = ""
    if located:
        import os
        import traceback

        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            last = frames[-1]
            where = f" (at {os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    # one line whatever the exception holds: a \r or an escape sequence in its text is outside text too
    return printable(f"{name}: {text}" if text else name) + where


def printable(text: str) -> str:
    """``text`` with control characters, line separators and lone surrogates escaped (``\\n``, ``\\udcff``).

    Why: a path or value goes into one log or output line. A newline in it would split a warning
    into a fake second line, and a surrogate (a non-UTF-8 file name decoded with
    ``surrogateescape``) raises ``UnicodeEncodeError`` on a strict UTF-8 stdout.
    """
    if _UNPRINTABLE.search(text) is None:
        return text
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace").decode("ascii")
                            if not 0xD800 <= ord(m.group()) <= 0xDFFF else f"\\u{ord(m.group()):04x}", text)


@dataclass(frozen=True)
class Problem:
    """One fault, printed as ``FILE:LINE: KEY: message``."""

    path: str
    line: int | None
    key: str
    message: str

    def __str__(self) -> str:
        """One line whatever the path, key or message hold (see :func:`printable`)."""
        path, key, message = printable(self.path), printable(self.key), printable(self.message)
        where = f"{path}:{self.line}" if self.line is not None else path
        return f"{where}: {key}: {message}" if key else f"{where}: {message}"


class QuantregError(Exception):
    """Raised at the edges (strict mode, the vLLM seam) with every problem in its message."""

    def __init__(self, problems: Sequence[Problem] | str) -> None:
        self.problems: tuple[Problem, ...] = (
            () if isinstance(problems, str) else tuple(problems)
        )
        text = problems if isinstance(problems, str) else "\n".join(map(str, problems))
        super().__init__(text)


STRICT_PREFIX = "quantreg (strict): "
"""How every strict refusal starts: one prefix for an operator (and vLLM's log) to find."""


def strict_error(message: str) -> QuantregError:
    """Strict mode's refusal: ``message`` (the text a lenient run logs, ``quantreg: ...``) as one
    ``quantreg (strict): ...`` line.

    The one constructor for strict refusals, wherever they are raised (the seams, start-up, a
    fingerprint, a class that refuses the registry's method): three forms had grown apart
    (``quantreg: ...``, ``quantreg: ... (strict)``, ``quantreg (strict): ...``), and a strict line
    an operator cannot grep for by one prefix is not one clear line.
    """
    text = printable(message)
    return QuantregError(text if text.startswith(STRICT_PREFIX) else STRICT_PREFIX + text.removeprefix("quantreg: "))


SUGGESTION_POOL = 64
"""Most choices handed to :mod:`difflib` for one word (~100 µs each); a bigger set is prefiltered."""
MAX_LISTED = 300
"""Most characters of names a message lists before "... and N more"."""


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """A ``; did you mean 'x'?`` suffix, or nothing when no choice is close.

    ``difflib`` costs ~7 µs per choice, so 300 unknown names against 10,000 methods took 20 s.
    Up to :data:`SUGGESTION_POOL` choices are compared as they are; from a larger set only the
    names nearest in sorted order and in sorted order of the reversed names are (a typo keeps
    either the start or the end of a name), a bounded pool however many names exist.
    """
    import difflib

    pool = list(choices) if len(choices) <= SUGGESTION_POOL else _nearby(word, tuple(choices))
    close = difflib.get_close_matches(word, pool, n=1, cutoff=0.6)
    return f"; did you mean {_quoted(close[0])}?" if close else ""


@functools.lru_cache(maxsize=8)
def _sorted_views(choices: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The choices sorted, and sorted by their reversed spelling (each reversed): built once per set."""
    return sorted(set(choices)), sorted({c[::-1] for c in choices})


def _nearby(word: str, choices: tuple[str, ...]) -> list[str]:
    forward, backward = _sorted_views(choices)
    half = SUGGESTION_POOL // 8  # 4 pools of this size: before/after, forward/backward
    i = bisect.bisect_left(forward, word)
    j = bisect.bisect_left(backward, word[::-1])
    near = forward[max(0, i - half): i + half] + [r[::-1] for r in backward[max(0, j - half): j + half]]
    return list(dict.fromkeys(near))


def name_list(names: Sequence[str], limit: int = MAX_LISTED) -> str:
    """``a, b, c`` for a message, cut to about ``limit`` characters with ``... and N more``.

    A registry may hold thousands of methods; listing them all made one log line of 80 KB.
    """
    shown: list[str] = []
    size = 0
    for name in names:
        size += len(name) + 2
        if size > limit and shown:
            break
        shown.append(name)
    rest = len(names) - len(shown)
    text = ", ".join(printable(n) for n in shown)
    return f"{text}, ... and {rest} more" if rest else text


def _quoted(name: str) -> str:
    return "'" + printable(name[:80]) + "'"


def type_name(value: object) -> str:
    """YAML's word for a value's type, for "expected X, got Y" messages (tables and ``verify:``)."""
    if value is None:
        return "null"
    for kind, word in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                       (list, "list"), (dict, "mapping")):
        if isinstance(value, kind):
            return word
    return type(value).__name__


_LOCATED = re.compile(r"^(?P<path>[^\n]*?):(?P<line>\d+): (?P<message>.*)$", re.S)
_PATHED = re.compile(r"^(?P<path>[^\s:][^\n]*?): (?P<message>.*)$", re.S)


def problem_json(fault: object, path: str | None = None, key: str | None = None) -> dict[str, object]:
    """A problem as the ``--json`` envelope's object: ``{path, line, key, message, text}``.

    ``text`` is the one-line form the terminal shows (what consumers of the older string lists read).
    A :class:`Problem` gives its fields; a mapping is taken as an object already made; anything
    else (a plugin failure, a checkpoint problem kept as ``PATH[:LINE]: message`` text) is split at
    its location prefix, or kept whole as the message. ``path`` / ``key``: the text is about this
    file or directory, or this option (a command's own refusal, whose message names it): then no
    prefix is looked for.
    """
    if isinstance(fault, Problem):
        return {"path": fault.path, "line": fault.line, "key": fault.key, "message": fault.message,
                "text": str(fault)}
    if isinstance(fault, Mapping):
        return dict(fault)
    text = str(fault)
    if path is not None or key is not None:
        return {"path": path, "line": None, "key": key or "", "message": text, "text": text}
    plugin = getattr(fault, "plugin", None)
    if plugin is not None:
        return {"path": None, "line": None, "key": str(getattr(fault, "hook", "") or ""),
                "message": str(getattr(fault, "message", text)), "plugin": str(plugin), "text": text}
    found = _LOCATED.match(text)
    if found:
        return {"path": found["path"], "line": int(found["line"]), "key": "", "message": found["message"],
                "text": text}
    found = _PATHED.match(text)
    if found and ("/" in found["path"] or "." in found["path"]):
        return {"path": found["path"], "line": None, "key": "", "message": found["message"], "text": text}
    return {"path": None, "line": None, "key": "", "message": text, "text": text}


class _EscapingFilter(logging.Filter):
    """Escapes the whole formatted message of every record (see :func:`quantreg_logger`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad %-format: logging would report it; keep the record as it is
            return True
        record.msg, record.args = printable(message), ()
        return True


_ESCAPING = _EscapingFilter()


def quantreg_logger(name: str = "vllm.quantreg") -> logging.Logger:
    """The logger of ``name`` (under ``vllm.quantreg``) with every message escaped by :func:`printable`.

    Why the log's one home for escaping: a log line quotes tables, plugins' reasons, paths and
    exceptions; a newline in any of them forged a second ``WARNING`` line in vLLM's log. A filter
    on each logger quantreg logs through escapes the formatted message once, so no call site
    has to remember (``tests/test_escaping.py`` checks every logger is made here).
    """
    logger = logging.getLogger(name)
    if _ESCAPING not in logger.filters:
        logger.addFilter(_ESCAPING)
    return logger
