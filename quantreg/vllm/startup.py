"""Start-up in each vLLM process: the run's own tables, their fingerprint, a clean strict exit, the trail.

**Where a run's tables can first be read.** ``additional_config`` is a field of vLLM's
``VllmConfig``, and vLLM 0.32 hands that config to no plugin callback: ``load_general_plugins()``
(``vllm/plugins/__init__.py:77``) calls every ``register()`` without arguments. The earliest
moments quantreg's code runs while a process *holds* the complete config are those very
``register()`` calls in the spawned processes, where the config is a local of the caller:

* EngineCore: ``EngineCore.__init__(self, vllm_config, ...)`` calls ``load_general_plugins()``
  first thing (``vllm/v1/engine/core.py:118-129``) -- before any Worker is spawned;
* Worker: ``WorkerWrapperBase.init_worker`` stores ``vllm_config`` and then calls
  ``load_general_plugins()`` (``vllm/v1/worker/worker_base.py:260-276``) -- before device
  init and before the model (hence any weight) is built.

:func:`caller_vllm_config` finds that local a few frames up (by type name, without importing
vLLM). Nothing earlier exists: the API server's ``register()`` runs inside
``AsyncEngineArgs.add_cli_args`` before argv is parsed (``engine/arg_utils.py:3202``), so the
driver has no config to read; ``VllmConfig.__post_init__`` only calls the *platform's*
``check_and_update_config`` (quantreg is not a platform plugin, vllm-gaudi is); and
``set_current_vllm_config`` is first entered around model construction. When no config is
found (the driver, children started by ``fork`` that inherit a registered state, a vLLM that
renames the local), the seam reads ``additional_config`` at the first MoE layer as before
(:meth:`quantreg.vllm.route.Route.registry`).

**Fingerprints.** The driver publishes ``QUANTREG_FINGERPRINT`` before any config exists, so
that one covers the environment's and plugins' tables (the *base*, compared by
:func:`quantreg.vllm.check_same_table`). The first process that reads run tables (EngineCore)
publishes the fingerprint of the *whole* registry as ``QUANTREG_RUN_FINGERPRINT`` before it
spawns the Workers (spawned children copy ``os.environ``); each Worker compares its own with it.

**Strict failures end the process with one line.** Raised in a vLLM child, a ``QuantregError``
is printed inside vLLM's 80-line "WorkerProc failed to start." traceback (which also quotes
quantreg's ``raise`` line) and vLLM's generic "Engine core initialization failed" follows it.
:func:`fail_strict` instead logs ONE ``quantreg (strict): ...`` ERROR line and raises
``SystemExit(1)``: ``run_engine_core`` handles ``SystemExit`` without a traceback
(``v1/engine/core.py:1498``) and ``WorkerProc.worker_main`` catches only ``Exception``. The API server process itself
(``python -m vllm.entrypoints.openai.api_server``, :func:`in_vllm_server`) ends the same way. In a
library caller's process (``LLM(...)`` without multiprocessing, tests) it raises the
``QuantregError`` ``from None``: a library must not exit its caller.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from .. import settings
from ..mode import Mode, decide_mode
from ..problems import STRICT_PREFIX, QuantregError, quantreg_logger
from ..registry import Registry
from ..table.file import Tier
from .context import ADDITIONAL_CONFIG_KEY, RunSettings, _current_vllm_config, parse_run_settings
from .fingerprint import PublishedFingerprint

if TYPE_CHECKING:
    from ..decision import Decision

logger = quantreg_logger("vllm.quantreg")

#: The name of the local that holds the config in ``EngineCore.__init__`` and ``init_worker``.
VLLM_CONFIG_LOCAL = "vllm_config"
#: Frames searched above ``register()``: load_general_plugins, then its caller (plus decorators).
MAX_DEPTH = 6
#: Process names of vLLM's children: multiprocessing's (``EngineCore``, ``EngineCore_DP0``,
#: ``VllmWorker-0``: ``v1/engine/utils.py:284``, ``v1/executor/multiproc_executor.py:747``) and
#: the log prefix's (``Worker_TP0``, set once the Worker decorates its logs).
CHILD_PREFIXES = ("EngineCore", "VllmWorker", "Worker")

_run_fingerprint = PublishedFingerprint(settings.RUN_FINGERPRINT, "table with the run's additional_config",
                                       "the process that read it first", "a table file changed")


# -- reading the run's settings from the caller's config --------------------------------------

def _is_vllm_config(value: Any) -> bool:
    cls = type(value)
    return cls.__name__ == "VllmConfig" and cls.__module__.startswith("vllm.config")


def caller_vllm_config(frame: FrameType | None, max_depth: int = MAX_DEPTH) -> Any | None:
    """The ``VllmConfig`` held as ``vllm_config`` by ``frame`` or one of its callers, else ``None``."""
    for _ in range(max_depth):
        if frame is None:
            return None
        candidate = frame.f_locals.get(VLLM_CONFIG_LOCAL)
        if _is_vllm_config(candidate):
            return candidate
        frame = frame.f_back
    return None


def settings_of(vllm_config: Any) -> RunSettings:
    """``additional_config["quantreg"]`` of a ``VllmConfig`` (empty settings when absent)."""
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict) or ADDITIONAL_CONFIG_KEY not in extra:
        return RunSettings()
    return parse_run_settings(extra[ADDITIONAL_CONFIG_KEY])


def startup_settings(frame: FrameType | None) -> RunSettings | None:
    """The run's settings if vLLM's config is visible from ``frame`` (``register()``'s caller), else ``None``."""
    vllm_config = caller_vllm_config(frame)
    return None if vllm_config is None else settings_of(vllm_config)


def mode_of(registry: Registry | None, settings: RunSettings | None) -> Mode:
    """The mode in force in this vLLM process: the registry's, the run's ``strict`` and what the
    driver shipped (:func:`.multinode.published_strict`), all decided by :func:`quantreg.mode.decide_mode`.

    ``registry`` ``None`` (none could be built) decides from the environment alone. Never raises:
    an unreadable mode counts as the environment's (the boundary must not fail deciding it).
    """
    from . import multinode

    run = settings.strict if settings is not None else None
    try:
        shipped = multinode.published_strict()
        return registry.mode(run, shipped) if registry is not None else decide_mode(os.environ, (), run, shipped)
    except Exception:
        return decide_mode(os.environ, ())


def registry_for_run(run: RunSettings | None, built_for: RunSettings | None = None) -> tuple[Registry, bool]:
    """The registry this run decides with, and whether it was rebuilt now: the process registry, or
    (when the run names ``additional_config`` tables it was not built for) one rebuilt with them
    (:func:`.multinode.build`, so a worker reads the driver's shipped bytes) and installed.

    Why one function: ``register()`` (at plugin load) and the seam (at the first layer, when the
    run's config is known) each built "the registry for this run" with their own code.
    """
    from ..registry import get_registry, set_registry
    from . import multinode

    registry = get_registry()
    if run is None or not run.config or run == built_for:
        return registry, False
    registry = multinode.build(config=run.config)
    set_registry(registry)
    return registry, True


def strict_now() -> bool:
    """The mode for an unexpected fault mid-run: the process registry's and the run's, when they can
    still be had, else the environment's (:func:`mode_of`)."""
    from ..registry import get_registry
    from .context import run_settings

    try:
        registry: Registry | None = get_registry()
        settings: RunSettings | None = run_settings()
    except Exception:
        registry, settings = None, None
    return mode_of(registry, settings).strict


def run_table_count(registry: Registry) -> int:
    """How many of the registry's tables came from the run (``additional_config`` / ``--config``)."""
    return sum(1 for t in registry.tables if t.tier == Tier.RUN)


def check_run_fingerprint(fingerprint: str, strict: bool, role: str = "", left_out: int = 0) -> None:
    """Every process that read the run's tables must hold the same registry (see the module doc)."""
    _run_fingerprint.check(fingerprint, strict, role, left_out)


def forget() -> None:
    """Undo :func:`check_run_fingerprint`'s publication (tests, ``unregister()``)."""
    _run_fingerprint.withdraw()


# -- failing strict ------------------------------------------------------------------------------

def process_role() -> str:
    """The vLLM process role, as vLLM's own log prefix names it: ``EngineCore``, ``Worker_TP1``, ...

    Cheap and import-free: vLLM 0.32 keeps the name it prints in each log line in
    ``vllm.logger._vllm_process_info`` (set by ``decorate_logs`` in ``v1/engine/core.py``
    ``run_engine_core`` as ``EngineCore`` / ``EngineCore_DP<n>`` and in
    ``v1/executor/multiproc_executor.py`` ``setup_proc_title_and_log_prefix`` as
    ``Worker[_DP<n>][_PP<n>][_TP<n>][_EP<n>]``), paired with the pid that set it so a forked child
    does not inherit its parent's name. Only a module vLLM already imported is read; otherwise
    the multiprocessing process name (``MainProcess`` in the driver) stands in.
    """
    vllm_logger = sys.modules.get("vllm.logger")
    info = getattr(vllm_logger, "_vllm_process_info", None) if vllm_logger is not None else None
    if isinstance(info, tuple) and len(info) == 2 and info[1] == os.getpid():
        return str(info[0])
    return multiprocessing.current_process().name



def in_vllm_child() -> bool:
    """True in vLLM's EngineCore and Worker processes (not the driver, not an in-process engine)."""
    if multiprocessing.parent_process() is None:
        return False
    names = (process_role(), multiprocessing.current_process().name)
    return any(name.startswith(CHILD_PREFIXES) for name in names)


#: ``__main__`` modules of vLLM's own server processes (``python -m vllm.entrypoints.openai.api_server``,
#: the ``vllm`` console script's ``vllm.entrypoints.cli.main``): a program, not a library caller.
SERVER_MAINS = ("vllm.entrypoints.",)


def in_vllm_server() -> bool:
    """True in the process of vLLM's API server / CLI (its ``__main__`` is a vLLM entry point).

    There a raise ends as a 25-line traceback with quantreg's message last (``register()`` runs
    inside ``add_cli_args``); a user's script that builds ``LLM(...)`` is a library caller and gets
    the exception instead.
    """
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = str(getattr(spec, "name", "") or "")
    if name.startswith(SERVER_MAINS):
        return True
    argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return argv0 == "vllm"


def strict_text(error: QuantregError) -> str:
    """The error as one ``quantreg (strict): ...`` line (several problems joined by ``; ``)."""
    text = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
    if text.startswith(STRICT_PREFIX):
        return text
    return STRICT_PREFIX + text.removeprefix("quantreg: ")


def fail_strict(error: QuantregError) -> NoReturn:
    """End start-up for ``error``: one ERROR line and ``SystemExit(1)`` in a vLLM child or vLLM's own
    server process, else (a library caller) raise it."""
    if in_vllm_child() or in_vllm_server():
        if logger.hasHandlers():
            logger.error("%s", strict_text(error))
        else:  # vLLM's log format is not set up yet (the API server's register() runs in add_cli_args)
            print(f"ERROR {strict_text(error)}", file=sys.stderr)
        for handler in logging.getLogger("vllm").handlers:
            handler.flush()
        sys.stderr.flush()
        raise SystemExit(1)
    raise error from None


# -- the audit trail ---------------------------------------------------------------------------

def moe_layer_count() -> int:
    """MoE layers the model config declares (the seam sees layers one at a time; vLLM has no
    "model built" callback), so a trail line says how many layers its decision covers; 1 outside
    a model config."""
    from ..models.moe_config import moe_layer_indices

    hf_config = getattr(getattr(_current_vllm_config(), "model_config", None), "hf_config", None)
    try:
        config = hf_config.to_dict() if hf_config is not None else None
        return len(moe_layer_indices(config)) if isinstance(config, dict) else 1
    except Exception:  # a config this reader does not know must not stop the layer
        return 1


def _trail_asked_for() -> bool:
    """Whether ``QUANTREG_DECISIONS`` names a trail (what :func:`quantreg.audit.decisions_path` reads)."""
    return bool(settings.value(settings.DECISIONS))


def record_decision(decision: Decision, registry: Registry, settings: RunSettings | None) -> None:
    """Append ``decision`` to ``QUANTREG_DECISIONS`` (a no-op without it; never raises).

    :mod:`quantreg.audit` is imported only when a trail is asked for (start-up budget, issue 24.7).
    """
    if not _trail_asked_for():
        return
    from .. import audit

    try:
        strict = mode_of(registry, settings).strict
        audit.record(decision, role=process_role(), layer_count=moe_layer_count(), strict=strict,
                     fingerprint=registry.fingerprint())
    except Exception as exc:  # the trail is best effort by contract: never take a layer down
        logger.warning("quantreg: decisions trail not recorded: %s: %s", type(exc).__name__, exc)
