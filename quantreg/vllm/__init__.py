"""vLLM integration: the ``vllm.general_plugins`` entry point ``quantreg``.

The only package of quantreg that imports vLLM, and only lazily: ``register()`` builds the
registry (plugins + tables, no torch) and arms a post-import hook; the MoE layer module is
patched when vLLM itself imports it.
"""

from __future__ import annotations

import os
import sys
from types import FrameType

from .. import settings
from ..problems import QuantregError, describe, printable, quantreg_logger, strict_error
from ..registry import Registry, get_registry, set_registry
from . import multinode, startup, versions
from .context import report_problems
from .dense import LINEAR_MODULE, LM_HEAD_MODULE, LOADER_MODULE, DenseSeam
from .fingerprint import PublishedFingerprint
from .importhook import PostImportHook
from .quantconfig import QuantConfigGuard
from .route import Route, report_faults
from .seam import MODULE, Seam

logger = quantreg_logger("vllm.quantreg")


_route = Route()  # the run state and the decide-and-build path both seams share
_seam = Seam(_route)
_hook = PostImportHook(MODULE, _seam.patch_module)
_dense = DenseSeam(_route)
_dense_hooks = (PostImportHook(LINEAR_MODULE, _dense.patch_linear),
                PostImportHook(LM_HEAD_MODULE, _dense.patch_lm_head),
                PostImportHook(LOADER_MODULE, _dense.patch_loader))
_keepers = QuantConfigGuard()
_registered = False
_inactive = False
"""Set when ``register()`` failed and undid itself: nothing of quantreg acts in this process."""
_table_fingerprint = PublishedFingerprint(settings.FINGERPRINT, "effective table", "its parent process",
                                         "a table file or plugin changed")


def _vllm_has_seam_module() -> bool:
    """Check for the MoE module's file without importing it (that import costs seconds)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    rel = os.path.join(*MODULE.split(".")[1:]) + ".py"
    return any(os.path.exists(os.path.join(root, rel)) for root in roots)


def register() -> None:
    """Entry point called by vLLM in every process. Cheap and idempotent.

    Where vLLM calls it holding its config (EngineCore, Worker), the run's ``additional_config``
    tables are read here, before any Worker starts or any weight loads (:mod:`.startup`).

    vLLM calls it with no ``try`` around it, so this is quantreg's one boundary at start-up:
    lenient, anything unexpected (whatever its class, ``SystemExit`` included) is logged as a
    WARNING and quantreg stays out of the way, so vLLM keeps choosing its own methods; strict,
    it becomes one ``quantreg (strict): ...`` line (:func:`.startup.fail_strict`: an ERROR line and
    a clean exit in vLLM's child processes, one ``QuantregError`` elsewhere). Only
    ``KeyboardInterrupt`` passes unchanged.
    """
    built: list[Registry] = []
    caller = sys._getframe(1)  # vLLM's frame: where its config is visible (startup.startup_settings)
    try:
        _register(built, caller)
    except KeyboardInterrupt:
        raise
    except QuantregError as exc:  # strict mode's own error: already one line
        startup.fail_strict(exc)
    except BaseException as exc:
        strict = startup.mode_of(built[0] if built else None, None).strict
        message = f"quantreg: register() failed unexpectedly: {printable(describe(exc))}"
        if strict:
            startup.fail_strict(strict_error(message))
        _deactivate()
        logger.warning("%s; quantreg is inactive in this process and vLLM keeps its own MoE methods", message)


def _deactivate() -> None:
    """What ``register()`` armed before it failed, undone: a process quantreg calls inactive must be one.

    Why: ``register()`` arms its import hooks and keepers before it fingerprints and publishes; a
    fault after arming (a tuned rule's evidence read at fingerprinting, before readers were total)
    left every hook armed while the WARNING said "inactive", so every MoE layer still went through
    the seam. Undone here in the order :func:`unregister` uses, each step on its own (never raises),
    and the process stays inactive: a later ``register()`` call does nothing.
    """
    global _registered, _inactive
    for step in (_hook.disarm, *(h.disarm for h in _dense_hooks), _dense.unpatch, _keepers.disarm, _seam.unpatch):
        try:
            step()
        except Exception as exc:  # one step failing must not keep the next armed
            logger.warning("quantreg: undoing register(): %s", printable(describe(exc)))
    _registered, _inactive = True, True


def _register(built: list[Registry], caller: FrameType | None) -> None:
    global _registered
    if _registered:
        return
    multinode.adopt_shipped_tables()  # a worker missing the driver's table files decides from the shipped bytes
    run = startup.startup_settings(caller)
    base = get_registry()
    built.append(base)
    registry, _ = startup.registry_for_run(run)
    built[0] = registry
    strict = startup.mode_of(registry, run).strict
    report_problems(run, strict=strict)
    report_faults(registry, strict=strict)
    _route.settings = run
    if not _vllm_has_seam_module():
        logger.warning("quantreg: this vLLM has no module %s; quantreg is inactive and vLLM chooses MoE "
                       "methods itself", MODULE)
        _registered = True
        return
    _hook.arm()
    for hook in _dense_hooks:  # linear layers and the lm_head (issue 30): patched when vLLM imports them
        hook.arm()
    _keepers.arm(registry)  # vllm-gaudi-like strips follow the table (never raises; post-import hooks only)
    _registered = True
    versions.warn_if_untested()
    fingerprint = registry.fingerprint()
    runs = startup.run_table_count(registry) if registry is not base else 0
    logger.info("quantreg: registry loaded, %d rules from %d tables%s, %d methods, fingerprint %s (pid %d)",
                len(registry.index.rules), len(registry.tables),
                f" ({runs} from additional_config)" if runs else "", len(registry.methods), fingerprint, os.getpid())
    role, dropped = startup.process_role(), _left_out(base)
    check_same_table(base.fingerprint(), strict=strict, role=role, left_out=dropped)
    if registry is not base:
        startup.check_run_fingerprint(fingerprint, strict=strict, role=role, left_out=_left_out(registry))
    multinode.publish(base)  # after check_same_table, which publishes the first process's fingerprint


def check_same_table(fingerprint: str, strict: bool, role: str = "", left_out: int = 0) -> None:
    """Every vLLM process must decide from the same table (see :mod:`.fingerprint`)."""
    _table_fingerprint.check(fingerprint, strict, role, left_out)


def _left_out(registry: Registry) -> int:
    """Pieces this process dropped: its faults (each already one WARNING) and what the shipment lost."""
    shipment = multinode.received()
    return len(registry.faults) + (len(shipment.notes) if shipment is not None else 0)


def unregister() -> None:
    """Undo ``register()`` (tests): restore vLLM's function and forget the registry."""
    global _registered, _inactive
    _table_fingerprint.withdraw()
    startup.forget()
    _hook.disarm()
    for hook in _dense_hooks:
        hook.disarm()
    _dense.unpatch()
    _keepers.disarm()
    multinode.withdraw()
    _seam.unpatch()
    set_registry(None)
    _registered = _inactive = False


def installed() -> bool:
    """True once the wrapper is in place on vLLM's class."""
    return _seam.patched is not None
