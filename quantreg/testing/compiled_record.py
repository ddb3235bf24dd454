"""What the kit's ``compiled`` check last said about each method's current build, for ``quantreg doctor``.

Why a record: whether a method survives vLLM's default (compiled) mode is known only by running it
under ``torch.compile`` (:mod:`.compiled`), which takes seconds and imports torch and vLLM; ``doctor``
must stay quick and import neither. So ``quantreg check-method`` writes the verdict, and ``doctor``
reads it back, but only while it is about the same build: the method's target module (its source's
SHA-256), its plugin's installed version and, for a compiled kernel, nothing more is assumed (a
rebuilt library changes the plugin's version or its Python module in practice; ``check-method``
again is the way to be sure). A record that does not match the build is reported as not checked.

Where: the cache directory of the table cache (``$QUANTREG_CACHE_DIR`` / ``~/.cache/quantreg``),
subdirectory ``compiled``; with caching off nothing is written and doctor says "not checked". Never
raises: a missing record is "not checked"; one that cannot be read or does not conform (a field
missing or of the wrong type, cut short, too large) is an ``unreadable record`` naming the file and
why (:mod:`quantreg.records`), never a verdict, and its text is escaped.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

from .. import records
from ..files import ReadRefused, read_regular
from ..methods import Method
from ..records import Field
from ..table.cache import directory
from ..writing import make_directory, replace_file

PASS, FAIL = "PASS", "FAIL"
MAX_SOURCE = 4 << 20  # a method module larger than this is not hashed (no record: "not checked")
MAX_RECORD = 64 << 10


def build_id(method: Method) -> str | None:
    """The method's build: its target, its module's source hash and its plugin's version (``None``
    when the module cannot be found without importing it)."""
    module = method.target.split(":", 1)[0]
    try:
        spec = importlib.util.find_spec(module)
        origin = spec.origin if spec is not None else None
        source = read_regular(origin, MAX_SOURCE, noun="a method module") if origin and origin.endswith(".py") else b""
    except (ImportError, ValueError, OSError, ReadRefused):
        return None
    try:
        version = importlib.metadata.version(method.plugin) if method.plugin else ""
    except (importlib.metadata.PackageNotFoundError, ValueError):
        version = ""
    return hashlib.sha256(f"{method.target}\0{version}\0".encode() + source).hexdigest()[:16]


def _path(method: Method) -> Path | None:
    root = directory()
    return None if root is None else root / "compiled" / f"{method.name}.json"


def record(method: Method, status: str, detail: str) -> None:
    """Keep the ``compiled`` check's verdict for this build (best effort: a read-only home keeps nothing)."""
    path, build = _path(method), build_id(method)
    if path is None or build is None:
        return
    try:
        make_directory(path.parent)
        replace_file(path, json.dumps({"build": build, "status": status, "detail": detail[:2000],
                                       "checked": time.strftime("%Y-%m-%d %H:%M:%S")}))
    except Exception:  # a cache: never a reason for check-method to fail
        return


FIELDS = (Field("build", (str,), pattern="[0-9a-f]{16}"), Field("status", (str,), choices=(PASS, FAIL)),
          Field("detail", (str,)), Field("checked", (str,), pattern=r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"))
"""What :func:`record` writes, checked field by field when read back (:mod:`quantreg.records`)."""
UNREADABLE = "unreadable record"


def recorded(method: Method) -> dict[str, Any]:
    """``{"status": PASS|FAIL|"not checked"|"unreadable record", "detail": ...}`` for the method's
    current build. A record that does not conform (another writer, a damaged or hostile file) is
    ``unreadable record`` with where and why, never read as a verdict; every text is escaped."""
    path = _path(method)
    unchecked = {"status": "not checked", "detail": f"run `quantreg check-method {method.name}` on this build"}
    if path is None:
        return unchecked
    try:
        data = records.read(path, FIELDS, max_bytes=MAX_RECORD, noun="a compiled-check record")
    except records.RecordFault as fault:
        return {"status": UNREADABLE, "detail": str(fault)}
    if data is None or data["build"] != build_id(method):
        return unchecked
    return {"status": data["status"], "detail": data["detail"], "checked": data["checked"]}


def doctor_line(method: Method, seen: dict[str, Any]) -> str:
    """One ``doctor`` line: is the method safe under vLLM's default (compiled) mode? Every field
    shown is escaped again (a caller may hand any mapping)."""
    status, name = seen.get("status"), records.text(method.name)
    detail, checked = records.text(seen.get("detail", ""), 2000), records.text(seen.get("checked", ""))
    if status == PASS:
        return f"compiled:  {name}: yes (check-method's compiled check passed on this build, {checked})"
    if status == FAIL:
        return (f"compiled:  {name}: no: {detail} (quantreg's seam still runs it behind its own op; "
                f"checked {checked})")
    if status == UNREADABLE:
        return f"compiled:  {name}: not known: {detail} (run `quantreg check-method {name}` to write it again)"
    return f"compiled:  {name}: not checked: {detail}"
