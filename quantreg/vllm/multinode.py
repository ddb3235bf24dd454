"""quantreg's settings and tables beyond one process tree (Ray workers, other nodes).

The problem. Inside one process tree (vLLM's default multiprocessing executor) every engine and
worker process inherits the driver's environment: ``QUANTREG_CONFIG``, ``QUANTREG_STRICT`` and
the ``QUANTREG_FINGERPRINT`` the driver published, so :func:`quantreg.vllm.check_same_table`
notices a process that loaded a different table. vLLM's Ray executor (the multi-node path on
GPU/HPU hosts) does not inherit: it copies to each worker only the variables
``vllm.ray.ray_env.get_env_vars_to_copy()`` names (those registered in ``vllm.envs`` and those
starting with ``VLLM_``, ``HF_``, ``NCCL_``, ... plus the comma-separated prefixes in
``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY``, read at call time). A worker on another node then
never saw ``QUANTREG_CONFIG``, decided from the default tables, published its own fingerprint,
and nothing noticed. And even with the variable copied, its value is a *path* on the driver's
node, which need not exist on the worker's.

The design, using only vLLM's own mechanisms:

1. **Settings travel.** On the driver, :func:`publish` appends ``QUANTREG_`` to
   ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY`` (keeping whatever the operator put there, and
   only if no listed prefix already covers it). Every ``QUANTREG_*`` variable, the published
   fingerprint included, then reaches each Ray worker. ``register()`` runs (as a
   ``vllm.general_plugins`` entry point) before vLLM creates its executor, and vLLM reads that
   variable when it copies the environment, so setting it in ``register()`` is in time.
2. **Table content travels, not just paths.** :func:`publish` also puts the text of every user
   table the driver read (``QUANTREG_CONFIG``) into ``QUANTREG_TABLES``: JSON of ``{path,
   sha256, text}`` plus the driver's fingerprint and strictness, zlib-compressed and base64'd
   (``zb64:`` prefix). A worker that *cannot read* a listed path (:func:`adopt_shipped_tables`,
   :func:`build`) builds its registry from the shipped bytes instead, through the very same
   :meth:`Registry.build` (the bytes are written to a private temporary file), and then names
   every rule by the driver's path. So rules, log lines (``-> my_method [/etc/t.yaml:3]``)
   and the fingerprint are the driver's exactly. A worker that *can* read the path reads its own
   file, as before: if that file differs, the fingerprints differ and the existing check fires.
   Tables too large to ship (over :data:`MAX_SHIPPED` encoded bytes) travel as path + digest
   only, and a worker without the file is then caught by the fingerprint check.
3. **A mismatch is detectable, also strictly.** The check compares with the fingerprint the
   driver published, which now travels. A driver that is strict because its *table* says
   ``strict: true`` ships that fact (:func:`published_strict`), so a worker lacking the table
   (and hence lenient by itself) still refuses to run with a different effective table.

Not covered by shipping: run-layer tables named in ``additional_config["quantreg"]["config"]``.
vLLM ships its config (the paths) to every worker itself, but the driver never reads those
files (only workers build layers), so each node needs them at the same path; a missing one is a
located "no such file" problem in that worker. Headless multiprocessing nodes (``vllm serve
--headless``, ``--data-parallel-address``) are separate process trees started by the operator:
no environment travels at all. For those, :func:`main` (``python -m quantreg.vllm.multinode``)
prints the ``QUANTREG_FINGERPRINT``/``QUANTREG_TABLES`` lines to export on the other nodes;
with them a headless node decides from the same bytes, or warns/fails (strict) when it cannot.

This module imports neither torch nor vLLM.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import os
import shlex
import sys
import tempfile
import zlib
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path

from .. import jsonread, settings
from ..loading import config_paths
from ..problems import Problem, printable, quantreg_logger
from ..registry import Registry, set_registry
from ..table.file import TableFile
from ..table.located import MAX_BYTES, ReadRefused, read_regular_file
from ..writing import write_new

logger = quantreg_logger("vllm.quantreg")

#: vLLM's knob for extra variable-name prefixes its Ray executor copies to workers.
RAY_PREFIXES_ENV = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
#: The prefix every quantreg setting shares.
#: The shipped user tables (see the module docstring for the format).
#: Largest encoded ``QUANTREG_TABLES`` value that carries table text. Linux refuses a single
#: environment string over 128 KiB at exec (MAX_ARG_STRLEN); half of that leaves headroom.
MAX_SHIPPED = 64 << 10
ENCODING = "zb64:"
MAX_PAYLOAD = 4 * MAX_SHIPPED
"""Most bytes a shipped payload may decompress to (it compresses text; more is a bomb, not tables)."""
PAYLOAD_DEPTH = 6
"""Deepest nesting of a payload (quantreg writes 3)."""
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class ShippedTable:
    """One user table as the driver read it: its path there, digest, and text (if small enough)."""

    path: str
    sha256: str
    text: str | None


@dataclasses.dataclass(frozen=True)
class Shipment:
    """What the driver published in ``QUANTREG_TABLES``."""

    fingerprint: str
    strict: bool
    tables: tuple[ShippedTable, ...]
    pid: int = 0
    notes: tuple[str, ...] = ()
    """What :meth:`decode` dropped, one sentence each (logged once by :func:`received`)."""

    def encode(self) -> str:
        payload = {"v": FORMAT_VERSION, "fingerprint": self.fingerprint, "strict": self.strict, "pid": self.pid,
                   "tables": [dataclasses.asdict(t) for t in self.tables]}  # notes stay with the reader
        blob = zlib.compress(json.dumps(payload, sort_keys=True).encode(), 9)
        return ENCODING + base64.b64encode(blob).decode("ascii")

    @classmethod
    def decode(cls, value: str) -> Shipment:
        """Parse a ``QUANTREG_TABLES`` value; ``ValueError`` when nothing of it can be used.

        Bounded (decompressed size, nesting, finite numbers: :mod:`quantreg.jsonread`). A bad
        piece is dropped alone and said in :attr:`notes`: a ``pid`` that is no integer becomes 0,
        a malformed table entry is left out, a table whose text does not match the ``sha256``
        that travels with it keeps its digest but loses its text (this node then needs the file).
        """
        if not value.startswith(ENCODING):
            raise ValueError(f"expected a value starting with '{ENCODING}'")
        try:
            blob = base64.b64decode(value[len(ENCODING):], validate=True)
            inflater = zlib.decompressobj()
            raw = inflater.decompress(blob, MAX_PAYLOAD + 1)
            if len(raw) > MAX_PAYLOAD or inflater.unconsumed_tail:
                raise ValueError(f"decompresses to more than {MAX_PAYLOAD} bytes")
            payload = jsonread.loads(raw, max_bytes=MAX_PAYLOAD, max_depth=PAYLOAD_DEPTH, nonfinite_as_none=True)
        except (binascii.Error, zlib.error, ValueError) as exc:
            raise ValueError(f"cannot decode it ({type(exc).__name__}: {printable(str(exc))[:200]})") from None
        if not isinstance(payload, dict) or payload.get("v") != FORMAT_VERSION:
            raise ValueError(f"expected format version {FORMAT_VERSION}")
        notes: list[str] = []
        fingerprint = payload.get("fingerprint")
        if not isinstance(fingerprint, str):
            raise ValueError("fingerprint: expected a string")
        strict = payload.get("strict")
        if not isinstance(strict, bool):
            notes.append("strict: expected true or false; read as false")
            strict = False
        pid = payload.get("pid", 0)
        if type(pid) is not int or not 0 <= pid < 1 << 32:
            notes.append("pid: expected a process id; read as 0")
            pid = 0
        entries = payload.get("tables")
        if not isinstance(entries, list):
            notes.append("tables: expected a list; no table shipped")
            entries = []
        tables = []
        for n, t in enumerate(entries):
            if not (isinstance(t, dict) and isinstance(t.get("path"), str) and isinstance(t.get("sha256"), str)
                    and (t.get("text") is None or isinstance(t.get("text"), str))):
                notes.append(f"tables[{n}]: expected {{path, sha256, text}}; this table is left out")
                continue
            text = t["text"]
            if text is not None and _digest(text.encode("utf-8", "surrogateescape")) != t["sha256"]:
                notes.append(f"tables[{n}] ({printable(t['path'])[:200]}): its text does not match the sha256 "
                             "shipped with it; the text is not used")
                text = None
            tables.append(ShippedTable(t["path"], t["sha256"], text))
        return cls(fingerprint, strict, tuple(tables), pid, tuple(notes))


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def shipment_for(registry: Registry, env: Mapping[str, str]) -> Shipment:
    """The user tables (``QUANTREG_CONFIG``) this process can read, with ``registry``'s fingerprint."""
    tables = []
    for path in dict.fromkeys(config_paths(env)):
        try:  # read like any table (a regular file, bounded, never blocking on a FIFO)
            data = read_regular_file(path, MAX_BYTES)
        except ReadRefused:  # the driver's own registry reports it; nothing to ship
            continue
        try:
            text: str | None = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        tables.append(ShippedTable(path, _digest(data), text))
    return Shipment(registry.fingerprint(), registry.strict, tuple(tables), os.getpid())


def _encoded_within_limit(shipment: Shipment) -> str:
    encoded = shipment.encode()
    if len(encoded) <= MAX_SHIPPED:
        return encoded
    logger.warning("quantreg: the user tables are %d bytes encoded, more than the %d that can travel in %s; "
                   "only their paths and digests are shipped, so every node needs the files themselves",
                   len(encoded), MAX_SHIPPED, settings.TABLES)
    return dataclasses.replace(shipment, tables=tuple(dataclasses.replace(t, text=None)
                                                      for t in shipment.tables)).encode()


#: What :func:`publish` changed in ``os.environ`` (name -> previous value or None), for :func:`withdraw`.
_changed: dict[str, str | None] = {}


def extend_ray_prefixes(env: MutableMapping[str, str]) -> bool:
    """Add ``QUANTREG_`` to ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY``, keeping the operator's entries.

    Returns whether the value changed. vLLM splits the value on commas and strips each entry,
    so appending ``,QUANTREG_`` is exactly additive.
    """
    current = env.get(RAY_PREFIXES_ENV, "")
    entries = [e.strip() for e in current.split(",") if e.strip()]
    if any(settings.PREFIX.startswith(e) for e in entries):  # already copied (e.g. the operator listed "QUANTREG_")
        return False
    env[RAY_PREFIXES_ENV] = ",".join([*entries, settings.PREFIX])
    return True


def publish(registry: Registry, env: MutableMapping[str, str] | None = None) -> Shipment | None:
    """(Driver, from ``register()``.) Make settings, fingerprint and tables reach every worker.

    Always extends vLLM's Ray copy list. Publishes ``QUANTREG_TABLES`` only in the process that
    published the fingerprint (the first to register) and only if nobody did yet: a worker must
    pass the driver's shipment on unchanged, never replace it with its own view.
    """
    own = env is None
    env = os.environ if env is None else env
    before = env.get(RAY_PREFIXES_ENV)
    if extend_ray_prefixes(env) and own:
        _changed.setdefault(RAY_PREFIXES_ENV, before)
    if (settings.raw(settings.TABLES, env) is not None
            or settings.raw(settings.FINGERPRINT, env) != registry.fingerprint()):
        return None
    shipment = shipment_for(registry, env)
    env[settings.TABLES] = _encoded_within_limit(shipment)
    if own:
        _changed.setdefault(settings.TABLES, None)
    return shipment


def withdraw() -> None:
    """Undo what :func:`publish` did to ``os.environ`` (``unregister()``, tests)."""
    while _changed:
        name, previous = _changed.popitem()
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def received(env: Mapping[str, str] | None = None) -> Shipment | None:
    """The shipment this process received, or ``None``; a malformed one is reported once and ignored."""
    env = os.environ if env is None else env
    value = settings.raw(settings.TABLES, env)
    if not value:
        return None
    try:
        shipment = Shipment.decode(value)
    except ValueError as exc:
        _note_once(f"quantreg: ignoring {settings.TABLES}: {exc}")
        return None
    if shipment.notes:
        _note_once(f"quantreg: {settings.TABLES} (pid {shipment.pid}): " + "; ".join(shipment.notes)
                   + "; the rest is used, and the fingerprint check compares what this process decides")
    return shipment


_noted: set[str] = set()


def _note_once(message: str) -> None:
    """One WARNING per distinct message and process (``received`` is asked several times per start)."""
    if message not in _noted:
        _noted.add(message)
        logger.warning("%s", message)


def published_strict(env: Mapping[str, str] | None = None) -> bool:
    """Whether the driver that shipped the tables was strict (so a mismatch here must fail)."""
    shipment = received(env)
    return shipment is not None and shipment.strict


def _missing_here(shipment: Shipment, env: Mapping[str, str]) -> list[ShippedTable]:
    """Shipped tables listed in this process's ``QUANTREG_CONFIG`` that it cannot read."""
    listed = set(config_paths(env))
    return [t for t in shipment.tables if t.path in listed and not os.access(t.path, os.R_OK)]


def build(config: Sequence[str | os.PathLike[str]] = (), env: Mapping[str, str] | None = None) -> Registry:
    """:meth:`Registry.build`, except that unreadable user tables come from the driver's shipment.

    Use wherever a vLLM process builds a registry from the environment (``register()``, the
    seam's run-layer rebuild), so a worker on another node decides from the driver's bytes.
    """
    env = os.environ if env is None else env
    shipment = received(env)
    missing = _missing_here(shipment, env) if shipment is not None else []
    usable = [t for t in missing if t.text is not None]
    for table in missing:
        if table.text is None:
            logger.warning("quantreg: the driver's table %s (sha256 %s) is not on this node (pid %d) and its text "
                           "did not arrive (too large to ship, or dropped on arrival: see %s above); this process "
                           "decides without it", printable(table.path), table.sha256[:16], os.getpid(), settings.TABLES)
    if shipment is None or not usable:
        return Registry.build(config=config, env=env)
    with tempfile.TemporaryDirectory(prefix="quantreg-shipped-") as tmp:
        renames: dict[str, str] = {}
        for i, table in enumerate(usable):
            local = Path(tmp) / f"{i}-{Path(table.path).name or 'table.yaml'}"
            write_new(local, table.text or "")
            renames[table.path] = str(local)
            logger.info("quantreg: table %s is not readable on this node (pid %d); deciding from the copy the "
                        "driver (pid %d) shipped in %s (sha256 %s)", table.path, os.getpid(), shipment.pid,
                        settings.TABLES, table.sha256[:16])
        paths = [renames.get(p, p) for p in config_paths(env)]
        local_env = {**env, settings.CONFIG: os.pathsep.join(paths)}
        built = Registry.build(config=config, env=local_env)
        # Registry.build read everything it needs; the files may go. Rules keep the driver's names.
        return renamed(built, {v: k for k, v in renames.items()}, env)


def renamed(registry: Registry, names: Mapping[str, str], env: Mapping[str, str]) -> Registry:
    """``registry`` with every table, rule, problem and table-defined method renamed per ``names``.

    The plugins object keeps ``env`` (this process's real environment) for its settings.
    """
    def table(t: TableFile) -> TableFile:
        path = names.get(t.path, t.path)
        return dataclasses.replace(
            t, path=path, rules=tuple(dataclasses.replace(r, path=names.get(r.path, r.path)) for r in t.rules),
            methods=tuple(dataclasses.replace(m, plugin=_renamed_plugin(m.plugin, names)) for m in t.methods))

    def problem(p: Problem) -> Problem:
        return dataclasses.replace(p, path=names.get(p.path, p.path))

    methods = {n: dataclasses.replace(m, plugin=_renamed_plugin(m.plugin, names)) for n, m in registry.methods.items()}
    headers = [dataclasses.replace(h, path=names.get(h.path, h.path)) for h in registry.headers]
    return Registry(registry.plugins, methods, [table(t) for t in registry.tables],
                    [problem(p) for p in registry.problems], headers)


def _renamed_plugin(plugin: str, names: Mapping[str, str]) -> str:
    """Table-defined methods are owned by ``"table <path>"``: rename that path too."""
    head, sep, path = plugin.partition(" ")
    return f"{head} {names[path]}" if head == "table" and sep and path in names else plugin


def adopt_shipped_tables(env: Mapping[str, str] | None = None) -> Registry | None:
    """(Worker, from ``register()`` before ``get_registry()``.) Install a registry built from
    the driver's shipped tables when a listed one is unreadable here; otherwise do nothing."""
    env = os.environ if env is None else env
    shipment = received(env)
    if shipment is None or not _missing_here(shipment, env):
        return None
    registry = build(env=env)
    set_registry(registry)
    return registry


def export_lines(registry: Registry, env: Mapping[str, str] | None = None) -> list[str]:
    """Shell ``export`` lines that give another node this node's tables and fingerprint."""
    env = os.environ if env is None else env
    shipment = shipment_for(registry, env)
    lines = [f"export {settings.FINGERPRINT}={shlex.quote(shipment.fingerprint)}",
             f"export {settings.TABLES}={shlex.quote(_encoded_within_limit(shipment))}"]
    if config_paths(env):
        lines.insert(0, f"export {settings.CONFIG}={shlex.quote(env.get(settings.CONFIG, ''))}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m quantreg.vllm.multinode``: print the exports for headless nodes (see the docstring)."""
    import argparse

    parser = argparse.ArgumentParser(description="Print the QUANTREG_* exports that make another vLLM node decide "
                                                 "from this node's tables (and fail or warn when it cannot).")
    parser.parse_args(argv)
    from ..registry import get_registry

    for line in export_lines(get_registry()):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
