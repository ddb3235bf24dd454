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

The run state, the decision and the build are the run's :class:`~.route.Route`, shared with the
dense seam (:mod:`.dense`); this module keeps what is the experts' own: the class it hooks, the key
from the quant config, a split's sides (:mod:`.token_split`) and the ``verify:`` wrapper.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..mode import Mode
from ..problems import QuantregError, describe, quantreg_logger
from ..registry import Registry
from .context import layer_key
from .platform import fused_moe_method_base
from .route import Route

if TYPE_CHECKING:
    from ..decision import Decision
    from .coverage import Coverage

logger = quantreg_logger("vllm.quantreg")

MODULE = "vllm.model_executor.layers.fused_moe.routed_experts"
CLASS = "RoutedExperts"


class Seam:
    """Installs and removes the wrapper; decides and builds through the run's :class:`~.route.Route`."""

    def __init__(self, run: Route | None = None) -> None:
        self.run = run if run is not None else Route()
        self.lock = self.run.lock
        self.patched: type[Any] | None = None
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
            self.run.forget()

    # -- routing -------------------------------------------------------------------------
    def route(self, original: Callable[..., Any], layer: Any, prefix: str, quant_config: Any, moe_config: Any) -> Any:
        """The seam's one boundary around :meth:`_route` (:meth:`.route.Route.contained`); what vLLM's own
        method raises is vLLM's and passes through untouched."""
        from_vllm: list[BaseException] = []

        def vllms_own(*args: Any) -> Any:
            try:
                return original(*args)
            except BaseException as exc:
                from_vllm.append(exc)
                raise

        return self.run.contained(prefix, lambda: self._route(vllms_own, layer, prefix, quant_config, moe_config),
                                  lambda: original(layer, prefix, quant_config, moe_config),
                                  passes=lambda exc: any(exc is e for e in from_vllm))

    def _route(self, original: Callable[..., Any], layer: Any, prefix: str, quant_config: Any, moe_config: Any) -> Any:
        key = layer_key(quant_config)
        registry, mode, decision = self.run.decide(key, lambda: layer_shape(moe_config), every_side=True)

        def vllms() -> Any:
            return original(layer, prefix, quant_config, moe_config)

        def side(one: Decision, tokens: str) -> tuple[Decision, Any]:
            """One side of a split down its walk (:meth:`.route.Route.split_side`): the serving decision and
            vLLM's own method or the serving method (with its rule's ``verify:``)."""
            return self.run.split_side(
                one, tokens, registry, moe_config, prefix, layer, fused_moe_method_base(), mode.strict, vllms,
                lambda method, serving: _verified(method, serving, prefix, layer, moe_config, mode, registry))

        if decision.is_split:
            from .token_split import build_split

            try:
                split = build_split(decision, side, prefix, mode.strict)
            except QuantregError:
                raise
            except Exception as exc:
                logger.warning("quantreg: %s %s: %s; using vLLM's own method", prefix, key, describe(exc))
                return vllms()
            return _opaque(split, layer, prefix)
        if decision.keeps_vllm:
            return vllms()
        serving, method = self.run.method_or_none(decision, registry, moe_config, prefix, layer,
                                                  fused_moe_method_base(), mode.strict)
        if method is None:
            return vllms()
        return _opaque(_verified(method, serving, prefix, layer, moe_config, mode, registry), layer, prefix)


def _verified(method: Any, decision: Decision, prefix: str, layer: Any, moe_config: Any, mode: Mode,
              registry: Registry) -> Any:
    """``method``, or its ``verify:`` wrapper where the rule verifies this layer (:mod:`.verify`)."""
    from .verify import maybe_verify  # torch and vLLM's MoE base: loaded by now, vLLM is building a layer

    return maybe_verify(method, decision, prefix, layer, moe_config, mode, registry)


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
