"""A table's name in the fingerprint: what the table *is*, never where this machine installed it.

Why: the fingerprint compares processes and nodes (``QUANTREG_FINGERPRINT``, the trail, strict
mode's refusal). Hashing absolute paths made two virtualenvs at different paths disagree about the
same tables. So:

* a table shipped inside an installed distribution (a plugin's ``rules.yaml``, quantreg's own
  ``registry.yaml``) is named ``DISTRIBUTION:RELATIVE/PATH`` (``quantreg-hpu-mxfp4:quantreg_hpu_mxfp4/
  rules.yaml``), relative to the ``sys.path`` entry it was found under;
* any other table (``QUANTREG_CONFIG``, ``--config``, ``additional_config``) is named by its tier
  and its position in that tier (``user#0``): the name the user gave it does not count, because
  the fingerprint already holds every rule's content (match, methods, options, line, verify), and two
  nodes that keep one table at different paths run the same rules. Renaming or moving a file is not
  a change; editing it is.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
from importlib import metadata
from pathlib import Path

from ..files import ReadRefused, read_regular
from ..installed import dist_name_version

#: Largest ``top_level.txt`` / ``RECORD`` read (torch's RECORD is ~2 MB).
MAX_RECORD_BYTES = 64 << 20
#: Tiers whose tables an operator names (QUANTREG_CONFIG, --config, additional_config): never ``DIST:``.
OPERATOR_TIERS = ("user", "run")


def _normal(name: str) -> str:
    """A project or import name compared the PEP 503 way (``quantreg-hpu-mxfp4`` == ``quantreg_hpu_mxfp4``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.lru_cache(maxsize=1)
def _metadata_dirs() -> dict[str, tuple[str, ...]]:
    """Normalised project name -> the ``*.dist-info`` / ``*.egg-info`` directories on ``sys.path``.

    One directory listing per ``sys.path`` entry: no metadata file is read here.
    """
    found: dict[str, list[str]] = {}
    for entry in sys.path:
        try:
            with os.scandir(entry or os.getcwd()) as listing:
                names = [(e.name, e.path) for e in listing if e.name.endswith((".dist-info", ".egg-info"))]
        except (OSError, ValueError):
            continue
        for name, path in names:
            found.setdefault(_normal(name.split("-", 1)[0].removesuffix(".egg-info")), []).append(path)
    return {k: tuple(v) for k, v in found.items()}


def _read(info: str, name: str) -> str | None:
    try:  # the one bounded reader: a FIFO or a huge file planted in a dist-info never blocks start-up
        return read_regular(os.path.join(info, name), MAX_RECORD_BYTES).decode("utf-8", "replace")
    except (ReadRefused, OSError):
        return None


def _provides(info: str, top: str) -> bool:
    """Whether the distribution whose metadata directory is ``info`` provides the import name ``top``:
    its ``top_level.txt``, else the first parts of its ``RECORD`` (what ``packages_distributions`` reads),
    else, for an editable install, a ``.pth`` file its ``RECORD`` lists naming a directory that holds
    ``top``.

    Why the ``.pth``: ``pip install -e .`` (hatchling, PEP 660) records no package file, only a
    ``.pth`` naming the source tree, so neither ``top_level.txt`` nor ``packages_distributions()``
    sees the package: a packaged table was then named by its tier under an editable install and by
    its distribution under a wheel (two fingerprints for one install), after a full metadata scan
    in every vLLM process (~230 ms of ``register()``).
    """
    text = _read(info, "top_level.txt")
    if text is not None and text.split():
        return top in text.split()
    record = _read(info, "RECORD")
    if record is None:
        return False
    rows = [line.split(",", 1)[0].strip('"') for line in record.splitlines()]
    if any(row.split("/", 1)[0] == top for row in rows if row.startswith(top + "/")):
        return True
    site = os.path.dirname(info)
    for row in rows:
        if row.endswith(".pth") and "/" not in row:
            for line in (_read(site, row) or "").splitlines():
                line = line.strip()
                if line and not line.startswith(("#", "import ", "import\t")) and os.path.isdir(
                        os.path.join(site, line, top)):
                    return True
    return False


@functools.cache
def _owners(top: str) -> tuple[str, ...]:
    """The distributions that provide the top-level import name ``top``.

    Why not just ``importlib.metadata.packages_distributions()``: it parses every installed
    distribution's METADATA and every line of every RECORD (torch's and vLLM's are tens of thousands
    of lines), ~250 ms here, five times the start-up budget of ``register()``, which fingerprints
    the tables in every vLLM process. So first the distributions *named* like the package (the
    usual case: ``quantreg``, ``quantreg-hpu-mxfp4``), checked through their ``top_level.txt`` or
    ``RECORD``; only when none of them provides it, the full scan. (A second, differently named
    distribution providing the same package, e.g. a namespace package, is then not seen: the name
    stays the same in every process of one install, which is what the fingerprint compares.)
    """
    candidates = [info for info in _metadata_dirs().get(_normal(top), ()) if _provides(info, top)]
    if candidates:
        names = set()
        for info in candidates:
            try:
                name = dist_name_version(metadata.PathDistribution(Path(info)))[0]
            except Exception:  # unreadable metadata of this distribution: its directory name stands in
                name = None
            names.add(str(name) if name else Path(info).name.split("-", 1)[0])
        return tuple(sorted(names))
    return _scanned_owners().get(top, ())


@functools.lru_cache(maxsize=1)
def _scanned_owners() -> dict[str, tuple[str, ...]]:
    """The full scan :func:`_owners` falls back to, once per process (not once per missed name)."""
    try:
        return {k: tuple(sorted(set(v))) for k, v in metadata.packages_distributions().items()}
    except Exception:  # broken metadata of some unrelated distribution must not stop the fingerprint
        return {}


def package_name(path: str) -> str | None:
    """``DIST:relative/path`` for a table inside an installed distribution's package, else ``None``."""
    try:
        cwd = os.getcwd()  # '' on sys.path is the current directory
    except OSError:  # it was removed: '' names nothing
        cwd = ""
    return _package_name(path, tuple(sys.path), cwd)


@functools.lru_cache(maxsize=256)
def _package_name(path: str, search: tuple[str, ...], cwd: str) -> str | None:
    """:func:`package_name` for one ``sys.path``: ``register()`` fingerprints the same tables several times."""
    try:  # the file's own symlink is not followed: a source tree's quantreg/registry.yaml links ../registry.yaml
        given = Path(path)
        target = given.parent.resolve() / given.name
    except (OSError, RuntimeError, ValueError):
        return None
    # The import system first: the deepest directory above the table that is a top-level package where
    # Python imports it from. That holds for a wheel (site-packages) and for an editable install whether
    # its .pth puts the source tree on sys.path (hatchling) or its finder maps the package alone
    # (setuptools' default editable mode puts no directory on sys.path: the sys.path walk below then
    # saw only the repository, asked for the owner of ``plugins`` and paid the full metadata scan).
    for ancestor in target.parents:
        if ancestor.name.isidentifier() and ancestor in _package_dirs(ancestor.name):
            dists = _owners(ancestor.name)
            if dists:
                return f"{dists[0]}:{target.relative_to(ancestor.parent).as_posix()}"
            break
    found: list[tuple[int, int, Path]] = []
    for i, entry in enumerate(search):
        try:
            root = Path(entry or cwd).resolve()
            rel = target.relative_to(root)
        except (OSError, RuntimeError, ValueError):
            continue
        if len(rel.parts) < 2 or not rel.parts[0].isidentifier():  # ``.venv/...`` under the cwd: no package
            continue
        found.append((len(rel.parts), i, rel))
    # The deepest sys.path entry names it, so it is asked first: an editable checkout puts both the
    # repository and a plugin directory under plugins/ on sys.path, and asking the shallower one for its owner
    # (``plugins``) would cost the full metadata scan for a name no distribution provides.
    for _, _, rel in sorted(found):
        dists = _owners(rel.parts[0])
        if dists:
            return f"{dists[0]}:{rel.as_posix()}"
    return None


def _package_dirs(name: str) -> tuple[Path, ...]:
    """Where the top-level package ``name`` is imported from (resolved), without importing it.

    A plugin's package is already in ``sys.modules`` when its table is named (its hook gave the
    table); otherwise ``find_spec`` asks the finders, which for a top-level name imports nothing.
    """
    module = sys.modules.get(name)
    locations = getattr(module, "__path__", None) if module is not None else None
    if locations is None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return ()
        locations = spec.submodule_search_locations if spec is not None else None
    dirs = []
    for location in locations or ():
        try:
            dirs.append(Path(location).resolve())
        except (OSError, RuntimeError, ValueError):
            continue
    return tuple(dirs)


def table_names(tables: list[tuple[str, str]]) -> dict[str, str]:
    """Each table path's fingerprint name, given ``(path, tier)`` pairs in precedence order."""
    names: dict[str, str] = {}
    counts: dict[str, int] = {}
    for path, tier in tables:
        if path in names:
            continue
        # operator tables are named by position whatever directory holds them (the module docstring)
        packaged = None if tier in OPERATOR_TIERS else package_name(path)
        if packaged is None:
            packaged = f"{tier}#{counts.get(tier, 0)}"
            counts[tier] = counts.get(tier, 0) + 1
        names[path] = packaged
    return names
