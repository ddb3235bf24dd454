"""The seam for vLLM's dense layers (issue 30): linear layers and the lm_head, one decision per layer.

Seam choice: vLLM gives every ``LinearBase`` its method inside ``LinearBase.__init__``
(``quant_config.get_quant_method(layer, prefix)``, or ``UnquantizedLinearMethod`` without a quant
config) and every ``ParallelLMHead`` inside ``VocabParallelEmbedding.__init__``. We wrap
``LinearBase.__init__`` and ``ParallelLMHead.__init__``: when vLLM's own constructor has chosen,
the registry decides for the key ``(quant format, model type, device, layer kind)``; ``vllm``
keeps vLLM's choice untouched, any other method is built as ``cls(vllms_method, **options)`` and
put in ``layer.quant_method``. For a linear layer that happens before the subclass creates its
weights (``ColumnParallelLinear.__init__`` calls ``self.quant_method.create_weights`` after
``super().__init__``); the lm_head has created its weights by then, with vLLM's own method, which
is what a method for bf16 checkpoints needs (it quantises them in ``process_weights_after_loading``).
Why not ``resolve_quant_method`` or ``get_quant_method``: an unquantized model (no quant config)
never calls them, and ``linear.py`` binds ``resolve_quant_method`` by name at import.

Contract, as for the MoE seam (:mod:`.seam`), through the same route (:mod:`.route`: the run's
registry, the decision, the build behind the one caller of plugin code): one decision per layer,
one log line per key; lenient, quantreg's own faults and a method that cannot be built or fails
in ``process_weights_after_loading`` leave vLLM's method in place with one WARNING; strict, one
``quantreg (strict):`` line. Coverage:
``model_loader.utils.process_weights_after_loading`` is wrapped to walk the model before vLLM
finalises it: a linear layer or lm_head that never passed the seam, or whose method was replaced
after the decision, is named in one WARNING per (class, key) when a dense rule could match it.

Imported by ``register()`` (cheap: no torch, no vLLM here); vLLM's classes are reached only when
vLLM imports their modules (:mod:`.importhook`).
"""

from __future__ import annotations

import functools
import re
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..keys import EXPERTS, LAYER_KINDS, Key
from ..problems import QuantregError, describe, printable, quantreg_logger, strict_error
from .platform import quantize_method_base
from .route import Route

if TYPE_CHECKING:
    from ..decision import Decision
    from ..registry import Registry

logger = quantreg_logger("vllm.quantreg")

LINEAR_MODULE = "vllm.model_executor.layers.linear"
LM_HEAD_MODULE = "vllm.model_executor.layers.vocab_parallel_embedding"
LOADER_MODULE = "vllm.model_executor.model_loader.utils"
MARK = "__quantreg_dense_original__"
LAYER_MARK = "_quantreg_dense"
_, ATTENTION, DENSE, LM_HEAD = LAYER_KINDS  # the layer kinds a key names (quantreg.keys), experts aside
_ATTENTION_PART = re.compile(r"(^|\.)(self_attn|attn|attention|self_attention|cross_attn|cross_attention)(\.|$)")


def layer_kind(layer: Any, prefix: str, lm_head: bool) -> str:
    """``lm_head`` for a ``ParallelLMHead``; ``attention`` for a linear layer inside an attention
    block (its prefix names one, as vLLM's models do: ``...attn.qkv_proj``, ``...self_attn.o_proj``);
    ``dense`` for every other linear layer (a dense MLP, a router)."""
    if lm_head:
        return LM_HEAD
    if _ATTENTION_PART.search(prefix) or type(layer).__name__ == "QKVParallelLinear":
        return ATTENTION
    return DENSE


class _Mark:
    """What the seam decided for one layer: kept on the layer for the coverage walk."""

    __slots__ = ("decided", "key", "method")

    def __init__(self, key: Key, method: Any, decided: str) -> None:
        self.key, self.method, self.decided = key, method, decided


class DenseSeam:
    """Wraps the two constructors and the loader's finalisation; decides and builds through the run's
    :class:`~.route.Route` (the one the MoE seam uses: one registry, one line per key)."""

    def __init__(self, run: Route | None = None) -> None:
        self.run = run if run is not None else Route()
        self.lock = threading.RLock()
        self.patched: list[tuple[type[Any], str, Any]] = []
        self.warned: set[tuple[str, str]] = set()

    # -- installing ----------------------------------------------------------------------
    def patch_linear(self, module: ModuleType) -> None:
        self._wrap_init(module, "LinearBase", lm_head=False)

    def patch_lm_head(self, module: ModuleType) -> None:
        self._wrap_init(module, "ParallelLMHead", lm_head=True)

    def _wrap_init(self, module: ModuleType, name: str, lm_head: bool) -> None:
        cls = getattr(module, name, None)
        original = cls.__dict__.get("__init__") if isinstance(cls, type) else None
        if cls is None or original is None:
            logger.warning("quantreg: this vLLM has no %s.%s.__init__; dense rules are inactive for it",
                           module.__name__, name)
            return
        with self.lock:
            if getattr(original, MARK, None) is not None:
                return
            dense = self

            @functools.wraps(original)
            def __init__(layer: Any, *args: Any, **kwargs: Any) -> None:
                original(layer, *args, **kwargs)
                dense.route(layer, lm_head)

            setattr(__init__, MARK, original)
            cls.__init__ = __init__
            self.patched.append((cls, "__init__", original))

    def patch_loader(self, module: ModuleType) -> None:
        original = getattr(module, "process_weights_after_loading", None)
        if original is None or getattr(original, MARK, None) is not None:
            return
        dense = self

        @functools.wraps(original)
        def process_weights_after_loading(model: Any, *args: Any, **kwargs: Any) -> Any:
            dense.check_coverage(model)
            return original(model, *args, **kwargs)

        setattr(process_weights_after_loading, MARK, original)
        with self.lock:
            module.process_weights_after_loading = process_weights_after_loading  # type: ignore[attr-defined]
            self.patched.append((module, "process_weights_after_loading", original))  # type: ignore[arg-type]

    def unpatch(self) -> None:
        with self.lock:
            for owner, attr, original in reversed(self.patched):
                setattr(owner, attr, original)
            self.patched.clear()
            self.warned.clear()

    # -- routing -------------------------------------------------------------------------
    def route(self, layer: Any, lm_head: bool) -> None:
        """The one boundary: quantreg's faults never stop a layer build unasked (:meth:`.route.Route.contained`)."""
        prefix = str(getattr(layer, "prefix", "") or "")
        self.run.contained(prefix, lambda: self._route(layer, prefix, lm_head), lambda: None)

    def _route(self, layer: Any, prefix: str, lm_head: bool) -> None:
        from .context import layer_key

        vllms = getattr(layer, "quant_method", None)
        kind = layer_kind(layer, prefix, lm_head)
        key = layer_key(_quant_config(layer)).of_layer(kind)
        registry, mode, decision = self.run.decide(key, lambda: model_dense_shape(kind), every_side=False)
        layer.__dict__[LAYER_MARK] = _Mark(key, vllms, decision.method)
        if decision.keeps_vllm:
            return
        decision, method = self.run.method_or_none(decision, registry, vllms, prefix, layer, quantize_method_base(),
                                                   mode.strict, where=f" for {printable(prefix)}")
        if method is None:  # vLLM's own method serves (what was decided could not be built)
            layer.__dict__[LAYER_MARK] = _Mark(key, vllms, decision.method)
            return
        self._contain_loading(method, vllms, layer, decision, mode.strict)
        from .dense_verify import maybe_verify_dense
        from .opaque import make_linear_opaque

        method = make_linear_opaque(maybe_verify_dense(method, vllms, decision, prefix, layer, mode), layer, prefix)
        layer.quant_method = method
        layer.__dict__[LAYER_MARK] = _Mark(key, method, decision.method)

    def _contain_loading(self, method: Any, vllms: Any, layer: Any, decision: Decision, strict: bool) -> None:
        """A method failing in ``process_weights_after_loading`` (lenient) gives the layer back to vLLM's
        method, whose weights it has not yet replaced: one WARNING, the server starts."""
        inner = method.process_weights_after_loading

        def process_weights_after_loading(target: Any) -> None:
            try:
                inner(target)
            except QuantregError:  # already one strict line (a verify: load check): passed on, never wrapped
                raise
            except Exception as exc:
                message = (f"quantreg: method '{decision.method}' for {decision.key} [{decision.source}] failed "
                           f"preparing {printable(str(getattr(target, 'prefix', '')))}: {type(exc).__name__}: "
                           f"{printable(str(exc))}")
                if strict or vllms is None:
                    raise strict_error(message) from exc
                logger.warning("%s; using vLLM's own method", message)
                target.quant_method = vllms
                target.__dict__[LAYER_MARK] = _Mark(decision.key, vllms, "vllm")
                vllms.process_weights_after_loading(target)

        method.process_weights_after_loading = process_weights_after_loading

    # -- coverage ------------------------------------------------------------------------
    def check_coverage(self, model: Any) -> None:
        """Every linear layer and lm_head of ``model`` passed the seam and kept what it decided.

        Only where it matters: a layer whose key a dense rule matches (or, unmarked, whose model has
        any dense rule). Never raises: it is a report about layers that are already built.
        """
        try:
            self._check_coverage(model)
        except Exception as exc:  # a report must not stop a load that is already done
            logger.warning("quantreg: the dense coverage check failed: %s", printable(describe(exc)))

    def _check_coverage(self, model: Any) -> None:
        from ..registry import get_registry

        registry = get_registry()
        if not _has_dense_rules(registry):
            return
        linear = _vllm_class(LINEAR_MODULE, "LinearBase")
        head = _vllm_class(LM_HEAD_MODULE, "ParallelLMHead")
        for name, module in model.named_modules():
            is_head = head is not None and isinstance(module, head)
            if not (is_head or (linear is not None and isinstance(module, linear))):
                continue
            mark = module.__dict__.get(LAYER_MARK)
            cls = type(module).__qualname__
            if mark is None:
                self._warn_once(cls, "bypassed", "quantreg: %s (%s) was built without passing quantreg's dense seam "
                                "(its class does not run %s.__init__); its method %s was not decided by the tables",
                                name, cls, "ParallelLMHead" if is_head else "LinearBase",
                                type(getattr(module, "quant_method", None)).__name__)
                continue
            current = getattr(module, "quant_method", None)
            if current is not mark.method and _base_of(current) is not mark.method:
                decision = registry.resolve(mark.key)
                if decision.rule is None:
                    continue
                self._warn_once(cls, str(mark.key), "quantreg: %s (%s) replaced the method quantreg decided for %s "
                                "('%s', [%s]) with %s after the decision; the table's choice is discarded",
                                name, cls, mark.key, mark.decided, decision.source, type(current).__name__)

    def _warn_once(self, cls: str, about: str, message: str, *args: Any) -> None:
        if (cls, about) in self.warned:
            return
        self.warned.add((cls, about))
        logger.warning(message, *args)


def _quant_config(layer: Any) -> Any:
    """The layer's quant config, else the model's: vLLM builds GPT-OSS's lm_head without one, yet it is
    part of an MXFP4 model, and the key names the model's format (``gpt_oss_mxfp4``), as for its experts."""
    found = getattr(layer, "quant_config", None)
    if found is not None:
        return found
    from .context import _current_vllm_config

    return getattr(_current_vllm_config(), "quant_config", None)


def model_dense_shape(kind: str) -> dict[str, int] | None:
    """The sizes a ``kind`` layer has in the model vLLM is building (its ``hf_config``; ``None`` unknown),
    compared with a tuned dense rule's ``shape`` pin (:func:`quantreg.pins.dense_shape`)."""
    from ..pins import CONFIG_NAMES, dense_shape
    from .context import _current_vllm_config

    model_config = getattr(_current_vllm_config(), "model_config", None)
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is None:
        return None
    return dense_shape({name: getattr(hf_config, name, None) for name in CONFIG_NAMES.values()}, kind)


def _base_of(method: Any) -> Any:
    """The method a ``verify:`` wrapper runs (so a watched method still counts as the decided one)."""
    return getattr(method, "quantreg_verified", None)


def _has_dense_rules(registry: Registry) -> bool:
    return any(r.match.layer is not None and set(r.match.layers) - {EXPERTS} for r in registry.index.rules)


def _vllm_class(module: str, name: str) -> type[Any] | None:
    import sys

    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None
