"""A table's name in the fingerprint: what the table *is*, never where this machine installed it.

Why: the fingerprint compares processes and nodes (``QUANTREG_FINGERPRINT``, the trail, strict
mode's refusal). Hashing absolute paths made two virtualenvs at different paths disagree about the
same tables. So:

* a table shipped inside an installed distribution (a plugin's ``rules.yaml``, quantreg's own
  ``registry.yaml``) is named ``DISTRIBUTION:RELATIVE/PATH`` (``quantreg-hpu-mxfp4:quantreg_hpu_mxfp4/
  rules.yaml``), relative to the ``sys.path`` entry it was found under;
* any other table (``QUANTREG_CONFIG``, ``--config``, ``additional_config``) is named by its layer
  and its position in that layer (``user#0``): the name the user gave it does not count, because
  the fingerprint already holds every rule's content (match, methods, options, line, verify), and two
  nodes that keep one table at different paths run the same rules. Renaming or moving a file is not
  a change; editing it is.
"""

from __future__ import annotations

import functools
import os
import sys
from importlib import metadata
from pathlib import Path


@functools.lru_cache(maxsize=1)
def _owners() -> dict[str, tuple[str, ...]]:
    """Top-level import name -> the distributions that provide it (one metadata scan per process)."""
    try:
        return {k: tuple(sorted(set(v))) for k, v in metadata.packages_distributions().items()}
    except Exception:  # broken metadata of some unrelated distribution must not stop the fingerprint
        return {}


def package_name(path: str) -> str | None:
    """``DIST:relative/path`` for a table inside an installed distribution's package, else ``None``."""
    try:
        target = Path(path).resolve()
    except (OSError, RuntimeError, ValueError):
        return None
    best: tuple[int, str] | None = None
    for entry in sys.path:
        try:
            root = Path(entry or os.getcwd()).resolve()
            rel = target.relative_to(root)
        except (OSError, RuntimeError, ValueError):
            continue
        if len(rel.parts) < 2:
            continue
        dists = _owners().get(rel.parts[0])
        if not dists:
            continue
        name = f"{dists[0]}:{rel.as_posix()}"
        if best is None or len(rel.parts) < best[0]:  # the deepest sys.path entry names it
            best = (len(rel.parts), name)
    return None if best is None else best[1]


def table_names(tables: list[tuple[str, str]]) -> dict[str, str]:
    """Each table path's fingerprint name, given ``(path, layer)`` pairs in precedence order."""
    names: dict[str, str] = {}
    counts: dict[str, int] = {}
    for path, layer in tables:
        if path in names:
            continue
        packaged = package_name(path)
        if packaged is None:
            packaged = f"{layer}#{counts.get(layer, 0)}"
            counts[layer] = counts.get(layer, 0) + 1
        names[path] = packaged
    return names
