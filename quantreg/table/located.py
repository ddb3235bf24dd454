"""Values read from a table file that remember where they were written, and how to store them.

Kept apart from :mod:`quantreg.table.yamlfile` (the parser) so that code handling parsed tables, and
the parse cache (:mod:`quantreg.table.cache`), never has to import PyYAML.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..files import ReadRefused as ReadRefused
from ..files import read_regular
from ..problems import type_name

MAX_NODES = 200_000
"""Most scalars and collections one document may add through aliases (an "alias bomb" bound).

Only nodes reached through an alias count: the text itself is bounded by :data:`MAX_BYTES`, so a
legitimate large table (12,000 rules are ~250,000 nodes) is never mistaken for a bomb.
"""
MAX_BYTES = 4 << 20
"""Largest table file read at all."""
MAX_DEPTH = 64
"""Deepest nesting of collections a table may have (a rule's options sit at depth 4).

Why a bound: PyYAML's composer, the converters, the parse cache and vLLM's own handling of
options all recurse, so a value nested a thousand levels deep would otherwise end in a
``RecursionError`` inside every vLLM process.
"""
MAX_INT_BITS = 13_000
"""Largest integer a table may hold (~3,900 decimal digits), so every value can be printed.

Python refuses to convert integers of more than 4,300 digits to text, and hexadecimal literals
are not bounded at all, so a larger one would make an error message (or ``--json``) raise.
"""


class YamlError(Exception):
    """A YAML-level fault with the 1-based line where it was found."""

    def __init__(self, line: int | None, key: str, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.key = key
        self.message = message


class LocatedDict(dict[Any, Any]):
    """A mapping that knows its own line and the line of each key."""

    line: int
    key_lines: dict[Any, int]


class LocatedList(list[Any]):
    """A sequence that knows its own line and the line of each item."""

    line: int
    item_lines: list[int]


def line_of(value: object, default: int | None = None) -> int | None:
    return getattr(value, "line", default)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building large acyclic structures.

    Loading a 10,000-rule table allocates ~10^6 objects; CPython runs a collection every ~700 net
    allocations and a full one every few thousand, which cost more than the parsing itself.
    Nothing built here forms cycles, so nothing is left for the collector to find afterwards.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def mapping_key_lines(raw: Any, where: str, line: int, fail: Callable[[int | None, str, str], None],
                      expected: str) -> dict[Any, int] | None:
    """The line of each key of a rule's sub-mapping (``tuned:``, ``verify:``) as read, for faults
    located at the key; or ``None`` after one fault at ``line``: ``expected ..., got <type>``."""
    if not isinstance(raw, dict):
        fail(line, where, f"expected {expected}, got {type_name(raw)}")
        return None
    lines: dict[Any, int] = getattr(raw, "key_lines", {})
    return lines


def to_json(value: Any) -> Any:
    """A JSON-ready form of a located document that keeps every line.

    Mappings become ``{"d": line, "k": [[key, key_line, value], ...]}`` and sequences
    ``{"l": line, "i": [[item_line, value], ...]}``; scalars (str, int, float, bool, None) stay as
    they are, so a JSON object always means a container.
    """
    if isinstance(value, LocatedDict):
        return {"d": value.line, "k": [[k, value.key_lines[k], to_json(v)] for k, v in value.items()]}
    if isinstance(value, LocatedList):
        return {"l": value.line, "i": [[line, to_json(v)] for line, v in zip(value.item_lines, value)]}
    if value is None or isinstance(value, (str, int, float)):
        return value
    raise TypeError(f"not a located YAML value: {type(value).__name__}")


def from_json(data: Any) -> Any:
    """Inverse of :func:`to_json`; raises ``ValueError`` on anything :func:`to_json` cannot produce."""
    if isinstance(data, dict):
        if data.keys() == {"d", "k"} and type(data["d"]) is int and isinstance(data["k"], list):
            out = LocatedDict()
            out.line = data["d"]
            out.key_lines = {}
            for entry in data["k"]:
                if not (isinstance(entry, list) and len(entry) == 3 and type(entry[1]) is int):
                    raise ValueError("bad mapping entry")
                key = entry[0]
                if isinstance(key, (dict, list)) or key in out:
                    raise ValueError("bad mapping key")
                out.key_lines[key] = entry[1]
                out[key] = from_json(entry[2])
            return out
        if data.keys() == {"l", "i"} and type(data["l"]) is int and isinstance(data["i"], list):
            seq = LocatedList()
            seq.line = data["l"]
            seq.item_lines = []
            for entry in data["i"]:
                if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int):
                    raise ValueError("bad sequence entry")
                seq.item_lines.append(entry[0])
                seq.append(from_json(entry[1]))
            return seq
        raise ValueError("unknown container")
    if isinstance(data, list):
        raise ValueError("bare list")
    return data


def read_regular_file(path: str | os.PathLike[str], cap: int) -> bytes:
    """The bytes of a table file: :func:`quantreg.files.read_regular` worded for tables."""
    return read_regular(path, cap, expected="a YAML file", noun="a table")


def file_identity(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the file a path names (links followed), or ``None`` when it cannot be stat'ed.

    Two paths with one identity are one table (a hard link, a bind mount, a symlink), however
    they are spelled; callers dedupe on it before reading.
    """
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino)
