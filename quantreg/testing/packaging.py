"""A plugin distribution's packaging, checked from its own tests: the entry point, the native build.

Why in the kit: every plugin asserts the same two things about itself as installed, and the kit is
where a third party finds what quantreg expects of a plugin.

* :func:`installed_entry_point`: the distribution installs exactly one ``quantreg`` entry point by
  the plugin's name, pointing at the module it means (a stale or doubled registration is the first
  thing a plugin author debugs when ``quantreg explain`` does not list their method).
* :func:`build_without_compiler`: a plugin that compiles a native kernel in its ``setup.py`` still
  installs where no C/C++ compiler works, with one line saying so (``<distribution>: compiled kernel
  NOT built (<why>)``) and no traceback, so its probe can say "unavailable" instead of the install
  failing (docs/writing-a-plugin.md, "A compiled kernel"). The check runs the real ``setup.py``
  with ``CC``/``CXX`` set to ``/bin/false``.

Both raise ``AssertionError`` with what was found, so they read as test failures in pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import ModuleType

from ..plugins import ENTRY_POINT_GROUP, group_entry_points

NOT_BUILT = "compiled kernel NOT built ("
"""What a plugin's ``setup.py`` prints (after ``<distribution>: ``) when its kernel could not be compiled."""


def installed_entry_point(name: str, module: ModuleType, distribution: str) -> metadata.EntryPoint:
    """The one ``quantreg`` entry point called ``name``; it must load ``module`` and come from ``distribution``.

    Read by :func:`quantreg.plugins.group_entry_points`, the reader quantreg's own start-up uses: what
    this passes is what the registry will find."""
    found = [e for e in group_entry_points(ENTRY_POINT_GROUP) if e.name == name]
    assert len(found) == 1, f"expected one {ENTRY_POINT_GROUP!r} entry point named {name!r}, found {len(found)}"
    (ep,) = found
    assert ep.value == module.__name__, f"entry point {name!r} names {ep.value!r}, not {module.__name__!r}"
    owner = ep.dist.name if ep.dist is not None else None
    assert owner == distribution, f"entry point {name!r} is installed by {owner!r}, not {distribution!r}"
    assert ep.load() is module, f"entry point {name!r} loads another object than {module.__name__}"
    return ep


def build_without_compiler(source: Path, distribution: str, timeout: float = 300.0) -> str:
    """Run ``setup.py build_ext --inplace`` in ``source`` with no working compiler; its output.

    Checked: the build exits 0, prints exactly one ``<distribution>: compiled kernel NOT built (...)``
    line and no traceback. What the build leaves behind (no library, the failure recorded for the
    probe) is the plugin's own to check."""
    env = {**os.environ, "CXX": "/bin/false", "CC": "/bin/false"}
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=source, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"setup.py failed without a compiler (exit {proc.returncode}):\n{output}"
    lines = [line for line in output.splitlines() if NOT_BUILT in line]
    assert len(lines) == 1 and lines[0].startswith(f"{distribution}: {NOT_BUILT}"), (
        f"expected one line '{distribution}: {NOT_BUILT}...', got {lines}:\n{output}")
    assert "Traceback" not in output, output
    return output
