"""The one place vLLM's MoE method creation is routed through the registry.

Seam choice: we wrap ``RoutedExperts._get_quant_method(prefix, quant_config, moe_config)``.
- It is where *every* routed-experts layer gets its method, for every quant config, so one
  wrapper covers all (quant format, model type, device) keys.
- It runs after the quant config is chosen, so the config itself stays untouched (the fused
  GPT-OSS checkpoint loader depends on ``get_name() == "gpt_oss_mxfp4"``).
- It never reads module globals such as ``mxfp4.GptOssMxfp4MoEMethod``, so it wins whatever
  order plugins load in and still works after vllm-gaudi rebinds that global.
Alternatives rejected: ``register_oot`` of ``RoutedExperts`` replaces the whole layer class
(one plugin only, and it fights hardware plugins that do the same); re-registering quant
configs changes ``get_name()`` and per-config code paths, and needs one patch per format.
When the decision is ``vllm`` the original function runs unchanged.
Subclasses that override the seam (with or without ``super()``) are covered by :mod:`.coverage`:
routed too, or named in one WARNING per class and key that quantreg could not decide.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .. import settings
from ..keys import Key
from ..methods import BuildContext
from ..mode import Mode
from ..plugins import PluginFailure
from ..problems import Problem, QuantregError, describe, printable, quantreg_logger, strict_error
from ..registry import Registry, get_registry
from . import startup
from .context import RunSettings, layer_key, report_problems, run_settings
from .platform import fused_moe_method_base

if TYPE_CHECKING:
    from ..decision import Decision
    from .coverage import Coverage

logger = quantreg_logger("vllm.quantreg")

MODULE = "vllm.model_executor.layers.fused_moe.routed_experts"
CLASS = "RoutedExperts"


class Seam:
    """Installs and removes the wrapper; keeps per-process logging state."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.patched: type[Any] | None = None
        self.logged: set[Key] = set()
        self.stale_logged: set[tuple[Key, str]] = set()
        self.settings: RunSettings | None = None
        self._coverage: Coverage | None = None
        self.signature_warned = False

    @property
    def coverage(self) -> Coverage:
        """The subclass coverage, made on first use: :mod:`.coverage` is imported only once vLLM
        imports its MoE module, not by every ``register()`` (the start-up budget, docs/design.md)."""
        if self._coverage is None:
            from .coverage import Coverage

            self._coverage = Coverage(self)
        return self._coverage

    # -- installing ----------------------------------------------------------------------
    def patch_module(self, module: ModuleType) -> None:
        """Wrap the seam on ``module.RoutedExperts`` and cover its subclasses (:mod:`.coverage`).

        Inactive, with one WARNING, when the class or method is missing or the method's signature
        is not ``(self, prefix, quant_config, moe_config)``: a changed seam means vLLM now passes
        something quantreg does not know, and guessing could break every layer build.
        """
        from .coverage import MARK, METHOD, signature_problem

        cls = getattr(module, CLASS, None)
        original = getattr(cls, METHOD, None) if cls is not None else None
        if cls is None or original is None:
            logger.warning(
                "quantreg: this vLLM has no %s.%s.%s; quantreg is inactive and vLLM chooses MoE methods itself",
                MODULE, CLASS, METHOD)
            return
        with self.lock:
            if getattr(original, MARK, None) is not None:
                self.patched = cls
                self.coverage.install(cls)
                return
            problem = signature_problem(original)
            if problem is not None:
                if not self.signature_warned:  # once per process, however often the hook fires
                    self.signature_warned = True
                    logger.warning(
                        "quantreg: this vLLM's %s.%s.%s takes %s, not (self, prefix, quant_config, moe_config); "
                        "quantreg is inactive and vLLM chooses MoE methods itself", MODULE, CLASS, METHOD, problem)
                return
            coverage = self.coverage

            @functools.wraps(original)
            def _get_quant_method(layer: Any, prefix: str, quant_config: Any, moe_config: Any) -> Any:
                return coverage.decide(original, layer, prefix, quant_config, moe_config)

            setattr(_get_quant_method, MARK, original)
            setattr(cls, METHOD, _get_quant_method)
            self.patched = cls
            coverage.install(cls)

    def unpatch(self) -> None:
        with self.lock:
            cls, self.patched = self.patched, None
            if cls is not None:
                from .coverage import MARK, METHOD

                current = cls.__dict__.get(METHOD)
                original = getattr(current, MARK, None)
                if original is not None:
                    setattr(cls, METHOD, original)
            if self._coverage is not None:
                self._coverage.uninstall()
            self.logged.clear()
            self.stale_logged.clear()
            self.settings = None

    # -- routing -------------------------------------------------------------------------
    def registry_for_run(self) -> tuple[Registry, Mode]:
        """The registry with this run's ``additional_config`` tables, and the mode in force.

        The mode is :meth:`Registry.mode` with the run's own ``strict`` added, the same rule
        ``register()`` applied without it. A rebuilt registry reports its faults once (warnings,
        or the error if strict); in strict mode the faults ``register()`` only warned about (the
        run asked for strict later) become the error too.
        """
        settings = run_settings()
        with self.lock:
            registry, rebuilt = startup.registry_for_run(settings, self.settings)
            self.settings = settings
        mode = startup.mode_of(registry, settings)
        report_problems(settings, strict=mode.strict)
        if rebuilt or mode.strict:
            report_faults(registry, strict=mode.strict)
        return registry, mode

    def route(self, original: Callable[..., Any], layer: Any, prefix: str, quant_config: Any, moe_config: Any) -> Any:
        """The seam's one boundary around :meth:`_route`: quantreg's faults never stop a layer build unasked.

        Lenient, anything unexpected in quantreg's part (whatever its class) is a WARNING and vLLM
        builds its own method for the layer; strict, it is one ``QuantregError`` line. What vLLM's
        own method raises is vLLM's and passes through untouched, as does ``KeyboardInterrupt``.
        """
        from_vllm: list[BaseException] = []

        def vllms_own(*args: Any) -> Any:
            try:
                return original(*args)
            except BaseException as exc:
                from_vllm.append(exc)
                raise

        try:
            return self._route(vllms_own, layer, prefix, quant_config, moe_config)
        except (KeyboardInterrupt, QuantregError):
            raise
        except BaseException as exc:
            if any(exc is e for e in from_vllm):
                raise
            message = f"quantreg: routing {printable(str(prefix))} failed unexpectedly: {printable(describe(exc))}"
            if startup.strict_now():
                raise strict_error(message) from None
            logger.warning("%s; using vLLM's own method", message)
        return original(layer, prefix, quant_config, moe_config)

    def _route(self, original: Callable[..., Any], layer: Any, prefix: str, quant_config: Any, moe_config: Any) -> Any:
        registry, mode = self.registry_for_run()
        strict = mode.strict
        key = layer_key(quant_config)
        decision = registry.resolve(key)
        self.log_once(decision, registry)
        if decision.unrunnable and strict:  # every side, the same reading as every tool's verdict (envelope)
            from ..answer import chain_notes

            one = decision.unrunnable[0].decision
            raise strict_error(f"{decision.summary()}; " + "; ".join(chain_notes(one)))
        for one in (s.decision for s in decision.sides):  # a split: every side, each by its own rule
            self.check_tuned(one, registry, moe_config, strict)
        if decision.is_split:
            from .token_split import build_split

            def side(one: Decision) -> Any:
                return self._build(one, registry, original, layer, prefix, quant_config, moe_config, mode)

            try:
                split = build_split(decision, side, prefix, strict)
            except QuantregError:
                raise
            except Exception as exc:
                logger.warning("quantreg: %s %s: %s; using vLLM's own method", prefix, key, describe(exc))
                return original(layer, prefix, quant_config, moe_config)
            return _opaque(split, layer, prefix)
        if decision.keeps_vllm:
            return original(layer, prefix, quant_config, moe_config)
        try:
            method = self._method(decision, registry, layer, prefix, moe_config)
        except QuantregError:  # already one strict line: passed on, never wrapped in a second prefix
            raise
        except Exception as exc:
            message = (f"quantreg: method '{decision.method}' for {key} [{decision.source}] could not be built: "
                       f"{type(exc).__name__}: {exc}")
            if strict:
                raise strict_error(message) from exc
            logger.warning("%s; using vLLM's own method", message)
            return original(layer, prefix, quant_config, moe_config)
        from .verify import maybe_verify  # torch and vLLM's MoE base: loaded by now, vLLM is building a layer

        return _opaque(maybe_verify(method, decision, prefix, layer, moe_config, mode), layer, prefix)

    @staticmethod
    def _method(decision: Decision, registry: Registry, layer: Any, prefix: str, moe_config: Any) -> Any:
        """The decided method built for this layer (its registration's ``build``, the layer in its context); raises."""
        context = BuildContext(decision.key, decision.method, decision.source, decision.options, prefix, layer)
        return registry.methods[decision.method].build(moe_config, context, base=fused_moe_method_base())

    def _build(self, decision: Decision, registry: Registry, original: Callable[..., Any], layer: Any, prefix: str,
               quant_config: Any, moe_config: Any, mode: Mode) -> Any:
        """One side of a split: vLLM's own method, or the side's method (with its rule's ``verify:``); raises."""
        if decision.keeps_vllm:
            return original(layer, prefix, quant_config, moe_config)
        method = self._method(decision, registry, layer, prefix, moe_config)
        from .verify import maybe_verify

        return maybe_verify(method, decision, prefix, layer, moe_config, mode)

    def check_tuned(self, decision: Decision, registry: Registry, moe_config: Any, strict: bool) -> None:
        """A tuned rule's evidence against this process (:mod:`quantreg.pins`), the layer's shape included.

        Lenient: one WARNING per differing field, once per key; the rule still decides as written
        (the decision, the trail and the fingerprint carry the flag). Strict: one
        ``quantreg (strict):`` line naming every field, and no start.
        """
        self.check_tuned_shape(decision, registry, layer_shape(moe_config), strict)

    def check_tuned_shape(self, decision: Decision, registry: Registry, shape: Mapping[str, int] | None,
                          strict: bool) -> None:
        """:meth:`check_tuned` with the layer's shape given (the dense seam's: :func:`quantreg.pins.dense_shape`)."""
        rule = decision.rule
        if rule is None or rule.tuned is None or (decision.key, rule.location) in self.stale_logged:
            return
        self.stale_logged.add((decision.key, rule.location))
        texts = list(decision.stale)
        if shape is not None:
            texts += [s.text() for s in registry.stale_evidence(rule, shape) if s.field == "shape"]
        if not texts:
            return
        where = f"{decision.key} [{decision.source}]"
        if strict:
            raise strict_error(f"tuned rule for {where} was measured elsewhere: " + "; ".join(texts))
        for text in texts:
            logger.warning("quantreg: tuned rule for %s is stale: %s; the rule still decides (re-run quantreg tune)",
                           where, text)

    def log_once(self, decision: Decision, registry: Registry | None = None) -> None:
        """One line per key, the same :class:`~quantreg.answer.Answer` line ``explain`` and ``plan`` give.

        WARNING when an operator should act (a fallback, vLLM's known limitation, a plugin's
        warning), else INFO. Never raises: the line is a report, the decision is already made.
        """
        if decision.key in self.logged:
            return
        self.logged.add(decision.key)
        registry = get_registry() if registry is None else registry
        startup.record_decision(decision, registry, self.settings)  # QUANTREG_DECISIONS, once per key
        try:
            from ..answer import answer

            said = answer(registry, decision.key)
            line, warns = said.line(), said.warns
        except Exception as exc:  # a report must not stop a layer that is already decided
            line = f"{decision.summary()}; (notes unavailable: {type(exc).__name__}: {exc})"
            warns = bool(decision.fallback)
        (logger.warning if warns else logger.info)("quantreg: %s", line)


def _opaque(method: Any, layer: Any, prefix: str) -> Any:
    """What quantreg built for a layer, as one opaque op call under vLLM's compiler (:mod:`.opaque`)."""
    from .opaque import make_moe_opaque

    return make_moe_opaque(method, layer, prefix)


def layer_shape(moe_config: Any) -> dict[str, int] | None:
    """(experts, hidden, intermediate, top_k) of the layer vLLM is building, unpadded; ``None`` if unknown."""
    try:
        hidden = getattr(moe_config, "hidden_dim_unpadded", None) or moe_config.hidden_dim
        inter = (getattr(moe_config, "intermediate_size_per_partition_unpadded", None)
                 or moe_config.intermediate_size)
        return {"experts": int(moe_config.num_experts), "hidden": int(hidden), "intermediate": int(inter),
                "top_k": int(moe_config.experts_per_token)}
    except (AttributeError, TypeError, ValueError):
        return None


def report_faults(registry: Registry, strict: bool) -> None:
    """Strict: raise one error with every fault. Lenient: one WARNING line per fault, saying what was left out.

    A table problem leaves its whole file out (not just the rule it names), a plugin failure
    leaves out what that plugin's hook registered, an environment problem falls back to the
    setting's default; the warning says which, so nobody reads it as "only this rule was dropped".
    """
    faults = registry.faults
    if not faults:
        return
    if strict:
        raise strict_error("; ".join(map(str, faults)))
    for fault in faults:
        logger.warning("quantreg: %s (%s)", fault, consequence(fault))


def consequence(fault: Problem | PluginFailure) -> str:
    """What a lenient start-up does about ``fault``, for its warning line."""
    if isinstance(fault, PluginFailure):
        return "left out; the other plugins and tables stay in force"
    if fault.path == settings.ENVIRONMENT:
        return "the default is used"
    return "this file is left out whole; the other tables stay in force"
