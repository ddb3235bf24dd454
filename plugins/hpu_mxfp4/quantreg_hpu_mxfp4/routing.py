"""Expert selection and data-parallel dispatch, as vllm-gaudi's MXFP4 method does them.

Kept apart from the method class so the routing rules can be read (and tested) on their own.
"""

from __future__ import annotations

import importlib
from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F

from quantreg.methods import BuildContext
from quantreg.vllm.context import UNKNOWN_MODEL, current_model_type

GPT_OSS = "gpt_oss"
ACTIVATION_ALIASES = {"gelu_tanh": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu", "quick_gelu": "gelu"}


def activation_name(activation: Any) -> str:
    """The kernel's activation string for vLLM's ``MoEActivation`` (or a plain name)."""
    name = activation.value if isinstance(activation, Enum) else str(activation)
    return ACTIVATION_ALIASES.get(name, name)


def model_type(context: BuildContext | None) -> str | None:
    """The layer's ``hf_config.model_type``, or None when unknown.

    Built by quantreg's seam, the method gets it from the key the registry resolved
    (``quantreg_context``); built directly (tests, other harnesses), it asks quantreg's one
    reader of vLLM's current config, so this plugin never re-reads vLLM's globals itself.
    """
    if context is None:
        return current_model_type()
    return None if context.key.model_type == UNKNOWN_MODEL else context.key.model_type


def uses_custom_routing(layer: Any) -> bool:
    grouped = bool(getattr(layer, "use_grouped_topk", False))
    return grouped or getattr(layer, "custom_routing_function", None) is not None


def unsupported_routing(moe_config: Any, layer: Any) -> list[str]:
    """What vLLM's router does for this layer that the in-method orders do not compute.

    The in-method orders are plain softmax + top-k (in one of two orders), nothing else; vLLM's
    router also knows, per layer:

    * hash routing: experts from ``hash_indices_table[input_ids]`` (``FusedMoEConfig.has_hash_routing``
      from 0.32; the table is on the layer from 0.33);
    * scoring functions other than softmax (``scoring_func``: ``sigmoid``, ``sqrtsoftplus``);
    * ``e_score_correction_bias`` added to the scores before top-k (DeepSeek-V3 style);
    * ``routed_scaling_factor`` != 1 applied to the top-k weights (the layer carries 1.0 when vLLM
      applies the factor to the output instead, which the runner does after any method);
    * ``require_decomposed_backend`` (0.33): vLLM adjusts routes after routing, so monolithic
      kernels are refused ("routes adjusted after routing").

    Each attribute is read with a default, so releases without a feature report nothing for it.
    ``layer`` may be ``None`` (not known yet): only ``moe_config`` is read then.
    """
    found: list[str] = []
    if getattr(moe_config, "has_hash_routing", False) or getattr(layer, "hash_indices_table", None) is not None:
        found.append("hash routing (hash_indices_table)")
    scoring = getattr(layer, "scoring_func", "softmax")
    if scoring != "softmax":
        found.append(f"scoring_func={scoring!r} (only softmax is computed in the method)")
    if getattr(layer, "e_score_correction_bias", None) is not None:
        found.append("e_score_correction_bias")
    scale = getattr(layer, "routed_scaling_factor", 1.0)
    if scale is not None and float(scale) != 1.0:
        found.append(f"routed_scaling_factor={float(scale):g}")
    if getattr(moe_config, "require_decomposed_backend", False):
        found.append("require_decomposed_backend (vLLM adjusts routes after routing)")
    return found


def check_in_method_routing(method: str, routing: str, prefix: str, unsupported: list[str]) -> None:
    """An explicitly requested in-method order on a layer whose routing it cannot compute: refuse.

    A ValueError raised while the method is built, naming the layer and the features: quantreg's
    seam then falls back to vLLM's own method (lenient) or stops (strict); it never runs a method
    that silently picks other experts than vLLM would.
    """
    if unsupported and routing in IN_METHOD:
        raise ValueError(
            f"{method}: layer '{prefix}' uses {', '.join(unsupported)}, which routing={routing!r} (computed inside "
            "the method) does not implement; use routing: auto or vllm to let vLLM's router select the experts")


IN_METHOD = ("topk_softmax", "softmax_topk")


def order_for(routing: str, model_type: str | None, layer: Any, unsupported: list[str] | None = None) -> str:
    """Which routing a layer gets: ``topk_softmax``, ``softmax_topk``, ``layer_router`` or ``vllm``.

    ``vllm`` means the method is modular: vLLM's router selects experts before ``apply``. In
    ``auto`` mode that is how grouped/custom routing is honoured on vLLM 0.32, whose
    ``RoutedExperts`` no longer carries the ``router`` the seed called (``layer_router``), and how
    every feature in ``unsupported`` (:func:`unsupported_routing`) is honoured: deferred to vLLM's
    router, never approximated. An explicit in-method order with such features is refused
    (:func:`check_in_method_routing`) before this is asked.
    """
    if routing != "auto":
        return routing
    if unsupported:
        return "vllm"
    if model_type == GPT_OSS:
        return "topk_softmax"
    if uses_custom_routing(layer):
        return "layer_router" if hasattr(layer, "router") else "vllm"
    return "softmax_topk"


def select_experts(order: str, layer: Any, x: torch.Tensor,
                   router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) for ``x`` from ``router_logits`` in the given order (not ``vllm``)."""
    top_k = int(layer.top_k)
    if order == "topk_softmax":
        weights, ids = torch.topk(router_logits, top_k, dim=-1)
        return F.softmax(weights, dim=-1, dtype=torch.float32), ids
    if order == "softmax_topk":
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), ids
    if order == "layer_router":
        weights, ids = layer.router.select_experts(hidden_states=x, router_logits=router_logits)
        return weights, ids
    raise ValueError(f"routing order {order!r} is not computed inside the method")


def dispatch_across_dp(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       is_sequence_parallel: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-gather tokens, ids and weights over DP with vllm-gaudi's helpers (imported lazily).

    When vllm-gaudi pre-allocated gather buffers (HPU graphs), each tensor is cast to its buffer's
    dtype first: the ids buffer is int64, so ids are dispatched as int64 and narrowed afterwards.
    """
    utils = importlib.import_module("vllm_gaudi.v1.worker.hpu_dp_utils")
    metadata = utils.get_hpu_dp_metadata()

    def gather(tensor: torch.Tensor, name: str) -> torch.Tensor:
        buffer = getattr(metadata, f"{name}_across_dp", None) if metadata is not None else None
        if buffer is not None and buffer.dtype != tensor.dtype:
            tensor = tensor.to(buffer.dtype)
        out: torch.Tensor = utils.dispatch_tensor(tensor, buffer, is_sequence_parallel)
        return out

    return gather(x, "hidden_states"), gather(ids, "topk_ids"), gather(weights, "topk_weights")
