"""Values read from a table file that remember where they were written, and how to store them.

Kept apart from :mod:`quantreg.yamlfile` (the parser) so that code handling parsed tables, and
the parse cache (:mod:`quantreg.tablecache`), never has to import PyYAML.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

MAX_NODES = 200_000
"""Most scalars and collections one document may expand to (aliases count every time)."""
MAX_BYTES = 4 << 20
"""Largest table file read at all."""


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
