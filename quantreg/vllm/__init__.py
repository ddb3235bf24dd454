"""vLLM integration: the ``vllm.general_plugins`` entry point ``quantreg``.

The only package of quantreg that imports vLLM, and only lazily: ``register()`` builds the
registry (plugins + tables, no torch) and arms a post-import hook; the MoE layer module is
patched when vLLM itself imports it.
"""

from __future__ import annotations

import logging
import os

from ..problems import QuantregError
from ..registry import get_registry, set_registry
from . import multinode, versions
from .importhook import PostImportHook
from .quantconfig import QuantConfigGuard
from .seam import MODULE, Seam, report_faults

logger = logging.getLogger("vllm.quantreg")

FINGERPRINT_ENV = "QUANTREG_FINGERPRINT"

_seam = Seam()
_hook = PostImportHook(MODULE, _seam.patch_module)
_keepers = QuantConfigGuard()
_registered = False
_published: str | None = None


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
    multinode.adopt_shipped_tables()  # a worker missing the driver's table files decides from the shipped bytes
    registry = get_registry()
    strict = registry.mode().strict or multinode.published_strict()
    report_faults(registry, strict=strict)
    if not _vllm_has_seam_module():
        logger.warning("quantreg: this vLLM has no module %s; quantreg is inactive and vLLM chooses MoE "
                       "methods itself", MODULE)
        _registered = True
        return
    _hook.arm()
    _keepers.arm(registry)  # vllm-gaudi-like strips follow the table (never raises; post-import hooks only)
    _registered = True
    versions.warn_if_untested()
    fingerprint = registry.fingerprint()
    logger.info("quantreg: registry loaded, %d rules from %d tables, %d methods, fingerprint %s (pid %d)",
                len(registry.index.rules), len(registry.tables), len(registry.methods), fingerprint, os.getpid())
    check_same_table(fingerprint, strict=strict)
    multinode.publish(registry)  # after check_same_table, which publishes the first process's fingerprint


def check_same_table(fingerprint: str, strict: bool) -> None:
    """Every vLLM process must decide from the same table.

    The first process to register (the driver) publishes its fingerprint in the environment,
    which vLLM's EngineCore and Worker processes inherit; a child that loads a different table
    (a file edited between process starts, a plugin upgraded) fails in strict mode, warns otherwise.
    """
    global _published
    parent = os.environ.get(FINGERPRINT_ENV)
    if not parent:
        os.environ[FINGERPRINT_ENV] = _published = fingerprint
        return
    if parent == fingerprint:
        return
    message = (f"quantreg: this process (pid {os.getpid()}) loaded a different effective table (fingerprint "
               f"{fingerprint}) than its parent process ({parent}): a table file or plugin changed between "
               "process starts, so processes may decide differently")
    if strict:
        raise QuantregError(message)
    logger.warning(message)


def unregister() -> None:
    """Undo ``register()`` (tests): restore vLLM's function and forget the registry."""
    global _registered, _published
    if _published is not None and os.environ.get(FINGERPRINT_ENV) == _published:
        del os.environ[FINGERPRINT_ENV]
    _published = None
    _hook.disarm()
    _keepers.disarm()
    multinode.withdraw()
    _seam.unpatch()
    set_registry(None)
    _registered = False


def installed() -> bool:
    """True once the wrapper is in place on vLLM's class."""
    return _seam.patched is not None
