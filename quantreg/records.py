"""Records one run wrote and another reads: the one point where they are checked and escaped.

Why: a record on disk (the kit's compile-check verdicts, a ``QUANTREG_DECISIONS`` trail line, ...)
was written by another process -- an older quantreg, a killed writer, a user's editor, a hostile
file in a shared cache directory. Printed raw it can set the terminal's title, clear the screen
or add a line of its choosing ("quantreg: all methods safe"); read loosely, a field of the wrong
type is shown as a verdict it never held (``"status": ["PASS"]`` as "yes"). So every command that
reads such a record goes through here: the file is read bounded (:func:`quantreg.files.read_regular`
and :func:`quantreg.jsonread.loads`: size, depth, strict JSON), each field is type-checked against
the record kind's :class:`Field` list, and anything that does not conform is one located
``unreadable record <path>: <why>`` fault, never a value. Text that passes is returned escaped
(:func:`quantreg.problems.printable`), bounded in length, so whatever prints it prints one line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import jsonread
from .files import ReadRefused, read_regular
from .problems import printable, type_name

_TEXT_LIMIT = 2000


@dataclass(frozen=True)
class Field:
    """One field of a record kind: its JSON type(s), whether it must be there, and for text a
    pattern it must match or the values it may take."""

    name: str
    kinds: tuple[type, ...]
    required: bool = True
    pattern: str | None = None
    choices: tuple[str, ...] = ()
    limit: int = _TEXT_LIMIT

    def problem(self, item: Mapping[str, Any]) -> str | None:
        if self.name not in item:
            return f"field '{self.name}' missing" if self.required else None
        value = item[self.name]
        if value is None and type(None) in self.kinds:
            return None
        # bool is an int in Python and JSON's true is not a count: checked by exact type
        if not any(type(value) is kind for kind in self.kinds):
            wanted = " or ".join(type_name(k()) if k is not type(None) else "null" for k in self.kinds)
            return f"field '{self.name}': expected {wanted}, got {type_name(value)}"
        if isinstance(value, str):
            if len(value) > self.limit:
                return f"field '{self.name}': {len(value):,} characters, more than {self.limit:,}"
            if self.choices and value not in self.choices:
                return f"field '{self.name}': {printable(value[:40])!r} is not one of {', '.join(self.choices)}"
            if self.pattern is not None and re.fullmatch(self.pattern, value) is None:
                return f"field '{self.name}': {printable(value[:40])!r} is not of the form it is written in"
        return None


class RecordFault(ValueError):
    """A record that does not conform: ``str()`` is ``unreadable record <where>: <why>``, escaped."""

    def __init__(self, where: str, why: str) -> None:
        self.where, self.why = printable(where), printable(why)
        super().__init__(f"unreadable record {self.where}: {self.why}")


def check(item: Any, fields: Sequence[Field], where: str) -> dict[str, Any]:
    """``item`` when it is a JSON object whose fields conform, its text escaped; else :class:`RecordFault`."""
    if not isinstance(item, dict):
        raise RecordFault(where, f"expected a JSON object, got {type_name(item)}")
    for field in fields:
        problem = field.problem(item)
        if problem is not None:
            raise RecordFault(where, problem)
    return {k: printable(v) if isinstance(v, str) else v for k, v in item.items()}


def read(path: str | os.PathLike[str], fields: Sequence[Field], *, max_bytes: int, noun: str) -> dict[str, Any] | None:
    """The record at ``path`` checked by :func:`check`; ``None`` when there is no such file
    (nothing recorded yet). Every other failure -- unreadable, too large, not strict JSON, cut
    short, a field missing or of the wrong type -- is a :class:`RecordFault` naming ``path``."""
    where = os.fspath(path)
    if not os.path.lexists(where):
        return None
    try:
        data = jsonread.loads(read_regular(where, max_bytes, noun=noun), max_bytes=max_bytes)
    except ReadRefused as exc:
        raise RecordFault(where, str(exc)) from None
    except jsonread.JsonRefused as exc:
        at = f" (line {exc.line})" if exc.line else ""
        raise RecordFault(where, f"not strict JSON{at}: {exc.message}; cut short or damaged") from None
    return check(data, fields, where)


def text(value: Any, limit: int = 200) -> str:
    """Any value from a record, for one line of output: escaped and cut to ``limit`` characters."""
    shown = printable(value if isinstance(value, str) else repr(value))
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."
