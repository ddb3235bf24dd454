"""The one bounded JSON reader: size, nesting depth, finite numbers, UTF-8; every refusal located.

Why one reader: quantreg reads JSON it did not write (a checkpoint's ``config.json``, safetensors
headers and index files, decisions-trail lines, ``QUANTREG_TABLES`` payloads, the parse cache).
``json.loads`` accepts ``NaN``/``Infinity`` (not JSON), turns ``1e400`` into ``inf``, raises
``RecursionError`` (a traceback) on nesting 200,000 deep, ``UnicodeDecodeError`` on non-UTF-8
bytes, and ``ValueError`` on 5,000-digit integers. :func:`loads` turns each of those into one
:class:`JsonRefused` naming the line and what was expected, and never raises anything else.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 64
"""Deepest nesting accepted (a config.json nests 3-4 levels; a trail line 2)."""
MAX_BYTES = 64 * 1024 * 1024
"""Largest document accepted unless the caller says otherwise."""

_STRINGS = re.compile(r'"(?:[^"\\\n]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


class JsonRefused(ValueError):
    """A document that is not bounded, strict JSON; ``line`` is 1-based (``None`` when unknown)."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.line = line


def _refuse_constant(name: str) -> Any:
    raise JsonRefused(f"{name} is not a JSON number (expected a finite number)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonRefused(f"{text[:40]} is out of range (expected a finite number)")
    return value


def _float_or_none(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _check_depth(text: str, max_depth: int) -> None:
    """Refuse nesting deeper than ``max_depth`` before ``json`` recurses into it."""
    if text.count("[") + text.count("{") <= max_depth:
        return
    stripped = _STRINGS.sub('""', text)  # a JSON string holds no raw newline: line numbers stay
    depth = 0
    for m in _BRACKETS.finditer(stripped):
        if m.group() in "[{":
            depth += 1
            if depth > max_depth:
                raise JsonRefused(f"nested more than {max_depth} levels deep", _line_of(stripped, m.start()))
        else:
            depth -= 1


def loads(data: bytes | str, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH,
          nonfinite_as_none: bool = False) -> Any:
    """Parse ``data`` as strict, bounded JSON; :class:`JsonRefused` for anything else (never another error).

    ``nonfinite_as_none``: ``NaN``/``Infinity``/``1e400`` become ``None`` instead of a refusal, for a
    reader that checks every field and drops exactly the bad one (the ``QUANTREG_TABLES`` payload).
    """
    if len(data) > max_bytes:
        raise JsonRefused(f"{len(data)} bytes; at most {max_bytes} are read")
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data.count(b"\n", 0, exc.start) + 1
            raise JsonRefused(f"not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})", line) from None
    else:
        text = data
    if text.startswith("\ufeff"):
        raise JsonRefused("starts with a byte-order mark (expected plain UTF-8 JSON)", 1)
    try:
        _check_depth(text, max_depth)
        if nonfinite_as_none:
            return json.loads(text, parse_constant=lambda _: None, parse_float=_float_or_none)
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except JsonRefused:
        raise
    except json.JSONDecodeError as exc:
        raise JsonRefused(f"not valid JSON: {exc.msg}", exc.lineno) from None
    except RecursionError:  # pragma: no cover - _check_depth keeps json well below the limit
        raise JsonRefused(f"nested more than {max_depth} levels deep") from None
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. an integer with more digits than Python allows
        raise JsonRefused(f"not readable JSON: {str(exc)[:100]}") from None


def dumps_strict(value: Any) -> str:
    """One line of strict JSON (ASCII): non-finite floats become the strings ``"NaN"``/``"Infinity"``/``"-Infinity"``.

    Why: ``json.dumps`` writes bare ``NaN``/``Infinity``, which ``jq`` and every strict reader
    (this module included) refuse; the trail must stay strict JSON exactly when a value is odd.
    """
    return json.dumps(finite(value), ensure_ascii=True, separators=(",", ":"), allow_nan=False, default=str)


def finite(value: Any) -> Any:
    """``value`` with non-finite floats as the strings ``"NaN"``/``"Infinity"``/``"-Infinity"`` (for strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, (str, int, float, bool)) and k is not None else k: finite(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value
