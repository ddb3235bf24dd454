"""vLLM integration: the ``vllm.general_plugins`` entry point ``quantreg``.

The only package of quantreg that imports vLLM, and only lazily: ``register()`` builds the
registry (plugins + tables, no torch) and arms a post-import hook; the MoE layer module is
patched when vLLM itself imports it.
"""

from __future__ import annotations

import logging
import os

from ..registry import get_registry, set_registry
from .importhook import PostImportHook
from .seam import MODULE, Seam, report_faults

logger = logging.getLogger("vllm.quantreg")

_seam = Seam()
_hook = PostImportHook(MODULE, _seam.patch_module)
_registered = False


def _vllm_has_seam_module() -> bool:
    """Check for the MoE module's file without importing it (that import costs seconds)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    rel = os.path.join(*MODULE.split(".")[1:]) + ".py"
    return any(os.path.exists(os.path.join(root, rel)) for root in roots)


def register() -> None:
    """Entry point called by vLLM in every process. Cheap and idempotent."""
    global _registered
    if _registered:
        return
    registry = get_registry()
    report_faults(registry, strict=registry.strict)
    if not _vllm_has_seam_module():
        logger.warning("quantreg: this vLLM has no module %s; quantreg is inactive and vLLM chooses MoE "
                       "methods itself", MODULE)
        _registered = True
        return
    _hook.arm()
    _registered = True
    logger.info("quantreg: registry loaded, %d rules from %d tables, %d methods, fingerprint %s (pid %d)",
                len(registry.index.rules), len(registry.tables), len(registry.methods), registry.fingerprint(),
                os.getpid())


def unregister() -> None:
    """Undo ``register()`` (tests): restore vLLM's function and forget the registry."""
    global _registered
    _hook.disarm()
    _seam.unpatch()
    set_registry(None)
    _registered = False


def installed() -> bool:
    """True once the wrapper is in place on vLLM's class."""
    return _seam.patched is not None
