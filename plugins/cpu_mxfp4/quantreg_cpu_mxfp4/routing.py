"""Expert selection for ``cpu_mxfp4``: the two softmax + top-k orders it computes, and what it leaves to vLLM.

Kept apart from the method class so the routing rules can be read (and tested) on their own.
What every monolithic method needs (the features softmax + top-k does not compute, the two
orders, global -> local ids) is quantreg's documented helper :mod:`quantreg.vllm.routing`; this
module holds only this method's choices (grouped/custom routing deferred, the ``auto`` rule).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch

from quantreg import BuildContext
from quantreg.vllm import routing as shared

UNKNOWN_MODEL = "unknown"
#: vLLM's MoE activation names -> the kernel's (``swigluoai``: interleaved gate/up with alpha/limit).
ACTIVATIONS = {"swigluoai": "swigluoai", "silu": "silu"}


def activation_name(activation: Any) -> str:
    """The kernel's activation for vLLM's ``MoEActivation`` (or a plain name); ValueError if none fits."""
    name = activation.value if isinstance(activation, Enum) else str(activation)
    if name not in ACTIVATIONS:
        raise ValueError(f"cpu_mxfp4: activation '{name}' is not computed by the kernel "
                         f"(supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def model_type(context: BuildContext | None) -> str | None:
    """The layer's ``model_type`` from the key quantreg resolved; None when built without a context."""
    if context is None or context.key.model_type == UNKNOWN_MODEL:
        return None
    return context.key.model_type


def unsupported_routing(moe_config: Any, layer: Any) -> list[str]:
    """What vLLM's router does for this layer that the in-method orders (plain softmax + top-k) do not.

    Grouped top-k and custom routing functions (this method calls no router for them), then
    quantreg's list (:func:`quantreg.vllm.routing.unsupported_routing`: hash routing, scoring
    functions other than softmax, ``e_score_correction_bias``, a ``routed_scaling_factor`` != 1,
    ``require_decomposed_backend``). ``layer`` may be None (not known yet).
    """
    found: list[str] = []
    if getattr(layer, "use_grouped_topk", False):
        found.append("grouped top-k")
    if getattr(layer, "custom_routing_function", None) is not None:
        found.append("a custom routing function")
    return found + shared.unsupported_routing(moe_config, layer)


def order_for(routing: str, model: str | None, unsupported: list[str]) -> str:
    """``topk_softmax`` (GPT-OSS), ``softmax_topk`` (others) or ``vllm`` (vLLM's router; modular)."""
    if routing != "auto":
        return routing
    if unsupported:
        return "vllm"
    return shared.default_order(model)


def select_experts(order: str, top_k: int, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights ``[T, k]``, ids ``[T, k]``) from ``router_logits`` in an in-method order."""
    return shared.select_in_method(order, top_k, router_logits)
