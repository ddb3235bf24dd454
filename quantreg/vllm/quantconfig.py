"""The table decides whether a checkpoint's quant config survives a third party's strip.

vllm-gaudi's ``models/gptoss_mxfp4.py`` patches vLLM so that a GPT-OSS MXFP4 checkpoint loads
as bf16 unless its own switch is set (plugin #1's README names it): its
``_normalize_quantization_config`` returns ``None``
(vLLM then builds no quant config, the key becomes ``(unquantized, gpt_oss, hpu)``) *and* its
``GptOssModel.load_weights`` dequantises the packed experts while loading. Both read the same
module global, the switch, when they run. quantreg's rule for the MXFP4 key could
never match while that switch is off, so the old switch would beat the table.

The mechanism (hook ``register_quant_config_keepers``, types in :mod:`quantreg.keepers`):

1. ``arm(registry)`` (from ``register()``, in every vLLM process) collects the keepers and arms
   one :class:`~.importhook.PostImportHook` per stripping module. Right after that module is
   imported (or at once, if it already is) the keeper's target gets ``should_keep``, a
   zero-argument callable, and makes the third party consult it where it reads its switch.
2. ``should_keep()`` is evaluated *at call time*, inside the third party's own code: it resolves
   ``(quant_format, model_type, vLLM's device)`` with the process registry and answers ``True``
   when the decision is a quantreg method. ``vllm`` (or a fallback to it) answers ``False``, so
   the third party behaves exactly as it does without quantreg.
3. Once a keeper has attached, a check on ``ModelArchConfigConvertorBase.get_quantization_config``
   (the only caller of ``_normalize_quantization_config`` in vLLM 0.32, patched by nobody) warns
   when the table asked to keep a config and it was stripped anyway (a third party changed how
   it strips). Without the third party nothing but the keepers' post-import hooks is armed.

Why this seam: the strip and the loader are the third party's code, both read one switch, and
the switch is read when they run. Acting on the switch's reader keeps the two consistent (a
kept config with the legacy bf16 loader would fail on uint8 parameters), is independent of
plugin order (the switch is only read long after every ``vllm.general_plugins`` entry point has
run, in whatever distribution-discovery order vLLM used), and needs no device check, so it is
testable on ``cpu``. Rejected: (a) wrapping ``_normalize_quantization_config`` at ``register()``
-- if vllm-gaudi loads after quantreg it saves our wrapper as its "original" and returns
``None`` without calling it; (b) re-patching it from the post-import hook of vllm-gaudi's module
-- that fixes the order but leaves ``load_weights`` dequantising into uint8 parameters; (c)
setting the switch in the environment -- read once at import, so too early or too
late depending on order, and it would decide before the device and the table are known;
(d) overriding the config in ``get_quantization_config`` from vLLM's own normaliser -- same
``load_weights`` problem, and only in the driver process while the loader runs in the Worker.

Limitation: the quant config is fixed while ``ModelConfig`` is built, before the ``VllmConfig``
(and its ``additional_config``) exists, so run-layer tables cannot un-strip a config; user
(``QUANTREG_CONFIG``) and plugin tables can.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..keepers import QuantConfigKeeper, keeper_problem, keeps_quant_config
from ..keys import Key
from ..methods import load_object
from ..problems import printable, quantreg_logger
from ..registry import Registry, get_registry
from .importhook import PostImportHook

logger = quantreg_logger("vllm.quantreg")

HOOK = "register_quant_config_keepers"
CONVERTOR_MODULE = "vllm.transformers_utils.model_arch_config_convertor"
CONVERTOR_CLASS = "ModelArchConfigConvertorBase"
CONVERTOR_METHOD = "get_quantization_config"
MARK = "__quantreg_keepers__"


def current_device() -> str:
    """vLLM's ``current_platform.device_type`` (the key's device, as the seam reads it)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


class QuantConfigGuard:
    """Keepers of one process: their post-import hooks, undo callables and logged decisions."""

    def __init__(self, device: Callable[[], str] = current_device,
                 registry: Callable[[], Registry] = get_registry) -> None:
        self.lock = threading.RLock()
        self.device = device
        self.registry = registry
        self.keepers: list[QuantConfigKeeper] = []
        self.hooks: list[PostImportHook] = []
        self.undo: list[Callable[[], None]] = []
        self.logged: set[tuple[str, Key, bool]] = set()
        self.convertor: type[Any] | None = None

    # -- arming ----------------------------------------------------------------------------
    def arm(self, registry: Registry) -> None:
        """Collect keepers from the plugins and watch for their modules. Never raises."""
        with self.lock:
            if self.hooks:
                return
            self.keepers = collect_keepers(registry)
            for keeper in self.keepers:
                hook = PostImportHook(keeper.module, functools.partial(self._attach, keeper))
                self.hooks.append(hook)
                hook.arm()

    def disarm(self) -> None:
        """Undo everything (tests): hooks, keepers' changes, the convertor check."""
        with self.lock:
            for hook in self.hooks:
                hook.disarm()
            self.hooks.clear()
            for undo in reversed(self.undo):
                undo()
            self.undo.clear()
            cls, self.convertor = self.convertor, None
            if cls is not None:
                original = getattr(cls.__dict__.get(CONVERTOR_METHOD), MARK, None)
                if original is not None:
                    setattr(cls, CONVERTOR_METHOD, original)
            self.keepers = []
            self.logged.clear()

    def _attach(self, keeper: QuantConfigKeeper, module: ModuleType) -> None:
        from ..hookcall import call  # the one caller of plugin code: SystemExit contained, "still ..." named

        def attach() -> Any:
            return load_object(keeper.target)(module, functools.partial(self.should_keep, keeper))

        undo, error = call(f"calling quant-config keeper '{printable(keeper.name)}' of plugin "
                           f"'{printable(keeper.plugin)}'", attach)
        if error is not None:  # a broken keeper must not stop vLLM: the third party then acts alone
            logger.warning("quantreg: quant-config keeper '%s' of plugin '%s' failed on %s: %s; %s decides alone",
                           printable(keeper.name), printable(keeper.plugin), keeper.module, printable(error),
                           keeper.module)
            return
        if callable(undo):
            self.undo.append(undo)
        with self.lock:  # a third party is there: watch vLLM's convertor too (once)
            if self.convertor is None and not any(h.module_name == CONVERTOR_MODULE for h in self.hooks):
                check = PostImportHook(CONVERTOR_MODULE, self._patch_convertor)
                self.hooks.append(check)
                check.arm()
        logger.debug("quantreg: keeper '%s' attached to %s", keeper.name, keeper.module)

    # -- deciding --------------------------------------------------------------------------
    def should_keep(self, keeper: QuantConfigKeeper) -> bool:
        """The table's answer for the keeper's key on this device, at call time. Never raises."""
        try:
            key = keeper.key(self.device())
            decision = self.registry().resolve(key)
        except Exception as exc:
            logger.warning("quantreg: cannot decide whether to keep the %s quant config of %s models (%s: %s); "
                           "leaving it to %s", keeper.quant_method, keeper.model_type, type(exc).__name__, exc,
                           keeper.module)
            return False
        keep = keeps_quant_config(decision)
        with self.lock:
            first = (keeper.name, key, keep) not in self.logged
            self.logged.add((keeper.name, key, keep))
        if first:
            if keep:
                logger.info("quantreg: %s: the table chose '%s' [%s], so the checkpoint's %s quant config is kept "
                            "(keeper '%s' of plugin '%s' overrides %s)", key, decision.method, decision.source,
                            keeper.quant_method, keeper.name, keeper.plugin, keeper.module)
            else:
                logger.info("quantreg: %s: the table chose vllm [%s]; %s keeps its own behaviour for the %s quant "
                            "config", key, decision.source, keeper.module, keeper.quant_method)
        return keep

    # -- checking --------------------------------------------------------------------------
    def _patch_convertor(self, module: ModuleType) -> None:
        cls = getattr(module, CONVERTOR_CLASS, None)
        original = getattr(cls, CONVERTOR_METHOD, None) if cls is not None else None
        if cls is None or original is None or getattr(original, MARK, None) is not None:
            return
        guard = self

        @functools.wraps(original)
        def get_quantization_config(convertor: Any) -> Any:
            result = original(convertor)
            guard.check_kept(getattr(convertor, "hf_config", None), result)
            return result

        setattr(get_quantization_config, MARK, original)
        setattr(cls, CONVERTOR_METHOD, get_quantization_config)
        self.convertor = cls

    def check_kept(self, hf_config: Any, result: Any) -> None:
        """Warn when a config the table asked to keep was stripped anyway."""
        raw = getattr(hf_config, "quantization_config", None)
        quant_method = raw.get("quant_method") if isinstance(raw, dict) else getattr(raw, "quant_method", None)
        model_type = getattr(hf_config, "model_type", None)
        for keeper in self.keepers:
            if keeper.matches(model_type, quant_method) and result is None and self.should_keep(keeper):
                logger.warning("quantreg: the table asked to keep the %s quant config of this %s checkpoint, but "
                               "something still stripped it (%s.%s is %s): vLLM loads it unquantized and the table's "
                               "rule for %s cannot apply", keeper.quant_method, keeper.model_type, CONVERTOR_CLASS,
                               "_normalize_quantization_config", _where(convertor_normaliser(self.convertor)),
                               keeper.key(self.device()))


def collect_keepers(registry: Registry) -> list[QuantConfigKeeper]:
    """Every valid keeper the plugins register; bad ones are logged (and recorded as plugin failures)."""
    from ..hookcall import remade
    from ..plugins import PluginFailure

    keepers: list[QuantConfigKeeper] = []
    before = len(registry.plugins.failures)
    for plugin, item in registry.plugins.call_each(HOOK):
        problem = keeper_problem(item)
        first = next((k for k in keepers if problem is None and k.name == item.name), None)
        if first is not None:
            problem = f"keeper '{item.name}' is already registered by plugin '{first.plugin}'; the first one is kept"
        if problem is not None:
            registry.plugins.failures.append(PluginFailure(plugin, HOOK, problem))
            logger.warning("quantreg: plugin '%s', hook '%s': %s (ignored)", plugin, HOOK, problem)
            continue
        keepers.append(remade(QuantConfigKeeper, item, plugin=plugin))
    for failure in registry.plugins.failures[before:]:  # what the one caller refused: raised, wrong type
        if failure.hook == HOOK:
            logger.warning("quantreg: %s (ignored)", failure)
    return keepers


def convertor_normaliser(cls: type[Any] | None) -> Any:
    return getattr(cls, "_normalize_quantization_config", None) if cls is not None else None


def _where(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
