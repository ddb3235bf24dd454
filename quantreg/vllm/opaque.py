"""quantreg's methods as one opaque call each in vLLM's compiled graph (vLLM's default mode, issue 43).

Why: without ``--enforce-eager`` vLLM traces the model's forward once with Dynamo (fullgraph; on the
CPU ``CompilationMode.DYNAMO_TRACE_ONCE`` with inductor) and reuses that graph for every batch size.
On the CPU vLLM 0.32 calls the MoE runner directly (``moe_runner._select_forward``: no
``torch.ops.vllm.moe_forward`` there, unlike CUDA and TPU), so the trace reaches the quant method's
``apply_monolithic`` / ``apply``. A plugin's ctypes kernel, a data-dependent expert loop, a
``tokens:`` split's bisect on the token count or ``verify:``'s sampling counter cannot be traced,
or worse, would be traced once and baked in (the split would serve every batch size with the side
the trace saw).

So every method object the seams hand to vLLM (a plugin's method, a :class:`~.verify.VerifyingMethod`,
a :class:`~.token_split.TokenSplitMethod`, a dense method or its verifying wrapper) gets its forward
entry points replaced, on the instance, by a function that under compilation records one call of a
``quantreg::`` custom op (with a fake implementation giving the output's shape and dtype) and in eager
mode calls the method as before (one ``torch.compiler.is_compiling()`` check). The op's real
implementation looks the layer up by a handle (its prefix) and runs the method eagerly: quantreg's
run-time pieces (the split's per-forward side, verify's counters, the trail) then run on every
forward, as in eager mode.

The compiled graph names only handles, not methods. vLLM caches compiled graphs on disk keyed by its
config hash (and, with AOT compile, reuses Dynamo's output without tracing again), which knows
nothing of quantreg's decisions: :func:`_note_in_compile_key` adds the handles, their op kind and
the traced attributes of each method to ``additional_config["quantreg_graph"]`` (hashed by
``VllmConfig.compute_hash``), so a run whose layers are routed differently compiles its own graph,
and one that only swaps which method serves a handle may reuse it (the op looks the method up at
run time).

Imports torch; imported by the seams only once vLLM builds a layer.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from typing import Any

import torch

from ..problems import quantreg_logger

logger = quantreg_logger("vllm.quantreg")

GRAPH_KEY = "quantreg_graph"  # additional_config key: the digest of the opaque calls in this process's graph

_lock = threading.Lock()
_calls: dict[str, _Call] = {}  # handle -> the layer and its method's original entry points


class _Call:
    """One layer's method, as the op's real implementation calls it (weak: the layer owns both)."""

    def __init__(self, layer: Any, entry: Any) -> None:
        try:
            self.layer: Any = weakref.ref(layer)
        except TypeError:  # not weakly referable (a test double, a slotted class): held for the process
            self.layer = lambda: layer
        self.entry = entry  # the method's own bound apply / apply_monolithic, called eagerly

    def target(self, handle: str) -> tuple[Any, Any]:
        layer = self.layer()
        if layer is None:
            raise RuntimeError(f"quantreg: the layer behind handle {handle!r} no longer exists")
        return layer, self.entry


def _lookup(handle: str) -> _Call:
    call = _calls.get(handle)
    if call is None:
        raise RuntimeError(f"quantreg: no method registered for handle {handle!r} in this process (a compiled "
                           "graph from another run? see docs/operating.md, 'vLLM's default mode')")
    return call


def _unaliased(out: Any, *inputs: torch.Tensor | None) -> torch.Tensor:
    """A custom op may not return a view of its inputs: copy when the method answered in place."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"quantreg: the method returned {type(out).__name__}, expected a tensor")
    for tensor in inputs:
        if tensor is not None and out.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            return out.clone()
    return out


# -- the ops (registered by calls, not decorators: torch's are untyped) --------------------------
def _moe_monolithic(x: torch.Tensor, router_logits: torch.Tensor, input_ids: torch.Tensor | None,
                    handle: str) -> torch.Tensor:
    """A monolithic MoE method's forward (routing included), run eagerly. ``x`` is declared mutated
    as vLLM declares it for its own ``moe_forward``: some kernels write their output into it."""
    layer, entry = _lookup(handle).target(handle)
    return _unaliased(entry(layer=layer, x=x, router_logits=router_logits, input_ids=input_ids), x, router_logits)


def _moe_modular(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, handle: str) -> torch.Tensor:
    """A modular MoE method's forward on routed tokens (vLLM's router stays in the graph), run eagerly."""
    layer, entry = _lookup(handle).target(handle)
    out = entry(layer=layer, x=x, topk_weights=topk_weights, topk_ids=topk_ids, shared_experts=None,
                shared_experts_input=None)
    return _unaliased(out, x, topk_weights)


def _linear(x: torch.Tensor, bias: torch.Tensor | None, handle: str) -> torch.Tensor:
    """A dense method's ``apply(layer, x, bias)``, run eagerly."""
    layer, entry = _lookup(handle).target(handle)
    return _unaliased(entry(layer, x, bias), x, bias)


def _like_x(x: torch.Tensor, *args: object) -> torch.Tensor:
    """The MoE output: the hidden states' shape and dtype."""
    return torch.empty_like(x)


def _linear_fake(x: torch.Tensor, bias: torch.Tensor | None, handle: str) -> torch.Tensor:
    layer, _entry = _lookup(handle).target(handle)
    out_features = _out_features(layer)  # read when traced: the layer is complete by then
    if out_features is None:
        raise RuntimeError(f"quantreg: the output width of {handle!r} is unknown")
    return x.new_empty((*x.shape[:-1], out_features))


MOE_MONOLITHIC: Any = torch.library.custom_op("quantreg::moe_monolithic", _moe_monolithic, mutates_args=("x",))
MOE_MODULAR: Any = torch.library.custom_op("quantreg::moe_modular", _moe_modular, mutates_args=("x",))
LINEAR: Any = torch.library.custom_op("quantreg::linear", _linear, mutates_args=())
MOE_MONOLITHIC.register_fake(_like_x)
MOE_MODULAR.register_fake(_like_x)
LINEAR.register_fake(_linear_fake)


# -- making a method opaque -------------------------------------------------------------------
def _handle(prefix: str) -> str:
    """The layer's prefix; a second layer with the same prefix in this process (a draft model) gets ``#2``."""
    handle, n = prefix or "<layer>", 1
    while handle in _calls and _calls[handle].layer() is not None:
        n += 1
        handle = f"{prefix}#{n}"
    return handle


def make_moe_opaque(method: Any, layer: Any, prefix: str) -> Any:
    """Give ``method`` (what the MoE seam returns to vLLM) forward entry points that compile to one op call.

    vLLM's runner calls ``quant_method.apply_monolithic(layer=..., x=..., router_logits=...,
    input_ids=...)`` for a monolithic method, else routes and calls ``quant_method.apply(layer=...,
    x=..., topk_weights=..., topk_ids=..., shared_experts=..., shared_experts_input=...)``. Calls
    with arguments an op cannot carry (shared experts, extra keywords of a later vLLM) go to the
    method directly, as in eager mode. Returns ``method``.
    """
    with _lock:
        handle = _handle(prefix)
        monolithic_entry = getattr(method, "apply_monolithic", None)
        modular_entry = getattr(method, "apply", None)
        monolithic = bool(getattr(method, "is_monolithic", False))
        _calls[handle] = _Call(layer, monolithic_entry if monolithic else modular_entry)
        _note_in_compile_key(handle, "moe_monolithic" if monolithic else "moe_modular", method)

    def apply_monolithic(layer: Any, x: torch.Tensor, router_logits: torch.Tensor,
                         input_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() and monolithic and not kwargs:
            return MOE_MONOLITHIC(x, router_logits, input_ids, handle)
        assert monolithic_entry is not None
        return monolithic_entry(layer=layer, x=x, router_logits=router_logits, input_ids=input_ids, **kwargs)

    def apply(layer: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts: Any = None, shared_experts_input: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if (torch.compiler.is_compiling() and not monolithic and shared_experts is None
                and shared_experts_input is None and not kwargs):
            return MOE_MODULAR(x, topk_weights, topk_ids, handle)
        assert modular_entry is not None
        return modular_entry(layer=layer, x=x, topk_weights=topk_weights, topk_ids=topk_ids,
                             shared_experts=shared_experts, shared_experts_input=shared_experts_input, **kwargs)

    # on the instance: proxies forward setattr to what they wrap, so write their own __dict__
    if monolithic_entry is not None:
        object.__setattr__(method, "apply_monolithic", apply_monolithic)
    if modular_entry is not None:
        object.__setattr__(method, "apply", apply)
    object.__setattr__(method, "quantreg_handle", handle)
    return method


def make_linear_opaque(method: Any, layer: Any, prefix: str) -> Any:
    """Give a dense method (what the dense seam puts in ``layer.quant_method``) an ``apply`` that compiles
    to one ``quantreg::linear`` call; the fake's width is the layer's output size. Returns ``method``."""
    with _lock:
        handle = _handle(prefix)
        entry = method.apply
        _calls[handle] = _Call(layer, entry)
        _note_in_compile_key(handle, "linear", method)

    def apply(layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() and not args and not kwargs:
            return LINEAR(x, bias, handle)
        return entry(layer, x, bias, *args, **kwargs)

    object.__setattr__(method, "apply", apply)
    object.__setattr__(method, "quantreg_handle", handle)
    return method


def _out_features(layer: Any) -> int | None:
    """The layer's output width as vLLM built it: ``output_size_per_partition`` (linear layers split
    over TP ranks), the rows of a vocab shard (lm_head: ``num_embeddings_per_partition``), else
    ``output_size`` (``ReplicatedLinear`` and its subclass ``GateLinear``, GPT-OSS's router: not
    split, and without the per-partition attribute in vLLM 0.32)."""
    for name in ("output_size_per_partition", "num_embeddings_per_partition", "output_size"):
        value = getattr(layer, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _note_in_compile_key(handle: str, op: str, method: Any) -> None:
    """Add this opaque call to ``additional_config["quantreg_graph"]`` of the vLLM config being built.

    The digest covers what the traced graph depends on: the handle, which op, and the attributes
    of the method vLLM reads while tracing (``is_monolithic``, ``topk_indices_dtype``, the class).
    Without it, a cached graph compiled while a layer ran vLLM's own method (traced inline) would be
    loaded for a run where quantreg routes that layer, and the other way round.
    """
    from .context import _current_vllm_config

    vllm_config = _current_vllm_config()
    extra = getattr(vllm_config, "additional_config", None)
    if vllm_config is None or not isinstance(extra, dict):
        if vllm_config is not None:
            logger.debug("quantreg: additional_config is not a dict; compiled graphs are not keyed by quantreg")
        return
    cls = type(method)
    entry = "|".join((handle, op, f"{cls.__module__}.{cls.__qualname__}",
                      str(getattr(method, "is_monolithic", None)), str(getattr(method, "topk_indices_dtype", None))))
    entries = _graph_entries.setdefault(id(vllm_config), [])
    entries.append(entry)
    extra[GRAPH_KEY] = hashlib.sha256("\n".join(sorted(entries)).encode()).hexdigest()[:16]


_graph_entries: dict[int, list[str]] = {}
