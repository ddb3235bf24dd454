"""Parsed package tables cached by content, so vLLM's start-up neither imports nor runs a YAML parser.

Why: every vLLM process (driver, engine core, each worker) calls ``register()``, which loads the
default table and the plugins' tables: the same few small files every time. Importing PyYAML
alone costs 15-25 ms here (its reader and resolver compile large regular expressions at import),
a third of the start-up budget. So a table that parsed cleanly is stored as JSON
(:func:`quantreg.table.located.to_json`, which keeps every line number for error messages), keyed by
the SHA-256 of its text and of this cache's format; the next process reads that instead.

Only tables shipped in packages (layers ``default`` and ``plugin``) are cached: they change only
when a package does, so entries stay few. Operator tables (``QUANTREG_CONFIG``, ``--config``) are
edited by hand and always parsed. A file that fails to parse is never cached, so its error always
comes from the parser itself.

Where: ``$QUANTREG_CACHE_DIR``, else ``$XDG_CACHE_HOME/quantreg``, else ``~/.cache/quantreg``;
``QUANTREG_CACHE_DIR=off`` disables it. The cache can never fail a load: an unreadable,
unwritable or corrupt entry means the text is parsed as if there were no cache (and a corrupt
entry is rewritten). Entries are trusted like ``__pycache__``: whoever can write the user's cache
directory can already change what the user's Python runs.

Integrity: an entry is ``<sha256 hex>\n<located JSON>``, the digest taken over this format, the
entry's own name (the text's digest) and the JSON. An entry damaged into different but valid
JSON (a flipped byte, a truncated copy, an entry renamed onto another text) fails the check and
is ignored and rewritten, never trusted. Checks that must speak for the files themselves
(``quantreg validate``, ``quantreg doctor``) run inside :func:`bypass`, which never reads entries.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import jsonread, settings
from ..files import WriteRefused
from ..writing import make_directory, replace_file
from .located import MAX_BYTES, MAX_DEPTH, ReadRefused, from_json, read_regular_file, to_json

FORMAT = b"quantreg-located-json-2\0"  # bump when to_json or the parser's results change meaning
MAX_ENTRY_BYTES = 8 * MAX_BYTES
"""Largest entry read or written: the located JSON of a table is a few times its text."""
ENTRY_DEPTH = 4 * MAX_DEPTH + 8
"""Deepest located JSON read back: each YAML level is a few JSON levels (:func:`to_json`)."""


def directory() -> Path | None:
    """The cache directory, or ``None`` when caching is off."""
    if settings.raw(settings.CACHE_DIR) is not None:
        configured = settings.value(settings.CACHE_DIR)
        return None if configured is None else Path(configured)
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        home = os.path.expanduser("~")
        if home.startswith("~"):  # no HOME and no passwd entry: nowhere sensible to write
            return None
        base = os.path.join(home, ".cache")
    return Path(base) / "quantreg"


def entry_path(text: str) -> Path | None:
    """Where the parse of ``text`` is (or would be) cached."""
    where = directory()
    if where is None:
        return None
    digest = hashlib.sha256(FORMAT + text.encode("utf-8", "surrogatepass")).hexdigest()
    return where / "tables" / f"{digest}.json"


_bypassing = 0
_bypass_lock = threading.Lock()


@contextlib.contextmanager
def bypass() -> Iterator[None]:
    """Parse every table from its text while inside: entries are not read (fresh ones are still written).

    For the commands whose answer is about the files (``validate``, ``doctor``): whatever state
    the cache is in, they report what the parser says. Nests; process-wide while active.
    """
    global _bypassing
    with _bypass_lock:
        _bypassing += 1
    try:
        yield
    finally:
        with _bypass_lock:
            _bypassing -= 1


def bypassed() -> bool:
    """True inside :func:`bypass`."""
    return _bypassing > 0


def parse(text: str, *, cache: bool) -> Any:
    """Parse one table's text, through the cache when ``cache`` is true (and not :func:`bypass`-ed)."""
    path = entry_path(text) if cache else None
    if path is not None and not bypassed():
        try:  # only a regular file, at most MAX_ENTRY_BYTES: a FIFO planted here must not hang start-up
            payload = _verified(path.name, read_regular_file(path, MAX_ENTRY_BYTES))
            if payload is not None:
                return from_json(jsonread.loads(payload, max_bytes=MAX_ENTRY_BYTES, max_depth=ENTRY_DEPTH))
        except (ReadRefused, OSError, ValueError, RecursionError):  # absent, unreadable or corrupt: parse it
            pass
    from .yamlfile import parse as parse_yaml

    doc = parse_yaml(text)  # raises YamlError: nothing is cached for a broken file
    if path is not None:
        _store(path, doc)
    return doc


def _checksum(name: str, payload: bytes) -> bytes:
    return hashlib.sha256(FORMAT + name.encode() + b"\0" + payload).hexdigest().encode()


def _verified(name: str, data: bytes) -> bytes | None:
    """The JSON payload of an entry whose checksum holds, else ``None``."""
    header, newline, payload = data.partition(b"\n")
    if not newline or not hmac.compare_digest(header, _checksum(name, payload)):
        return None
    return payload


def read_entry(path: Path) -> Any | None:
    """The located JSON stored in an entry if its checksum holds (for tools and tests), else ``None``."""
    try:
        payload = _verified(path.name, read_regular_file(path, MAX_ENTRY_BYTES))
        return None if payload is None else jsonread.loads(payload, max_bytes=MAX_ENTRY_BYTES, max_depth=ENTRY_DEPTH)
    except (ReadRefused, ValueError, RecursionError):
        return None


def encode_entry(name: str, data: Any) -> bytes:
    """The bytes of an entry named ``name`` holding the located JSON ``data`` (what :func:`_store` writes)."""
    payload = json.dumps(data, separators=(",", ":")).encode()
    return _checksum(name, payload) + b"\n" + payload


def _store(path: Path, doc: Any) -> None:
    """Write atomically (temporary file, then rename), so a reader never sees half an entry."""
    try:
        data = encode_entry(path.name, to_json(doc))
        if len(data) > MAX_ENTRY_BYTES:
            return
        make_directory(path.parent)
        replace_file(path, data)  # the one writer: never over a FIFO or device left at this name
    except (WriteRefused, OSError, TypeError, ValueError, RecursionError):  # read-only home, full disk...: no cache
        pass
