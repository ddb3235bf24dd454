"""Expert selection for ``cpu_mxfp4``: the two softmax + top-k orders it computes, and what it leaves to vLLM.

Kept apart from the method class so the routing rules can be read (and tested) on their own.
(The same ideas as quantreg-hpu-mxfp4's routing, written again here: that is another
distribution, and a third-party plugin cannot import it.)
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F

from quantreg.methods import BuildContext

GPT_OSS = "gpt_oss"
UNKNOWN_MODEL = "unknown"
IN_METHOD = ("topk_softmax", "softmax_topk")
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

    Grouped top-k and custom routing functions, hash routing (``has_hash_routing`` /
    ``hash_indices_table``), scoring functions other than softmax, ``e_score_correction_bias``,
    a ``routed_scaling_factor`` != 1 on the weights, ``require_decomposed_backend`` (vLLM 0.33
    adjusts routes after routing). Each is read with a default, so releases without a feature
    report nothing for it; ``layer`` may be None (not known yet).
    """
    found: list[str] = []
    if getattr(layer, "use_grouped_topk", False):
        found.append("grouped top-k")
    if getattr(layer, "custom_routing_function", None) is not None:
        found.append("a custom routing function")
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


def check_in_method_routing(routing: str, prefix: str, unsupported: list[str]) -> None:
    """An explicit in-method order on a layer whose routing it does not compute: a ValueError at build.

    quantreg's seam then falls back to vLLM's own method (lenient) or stops (strict); the method
    never runs with experts other than those vLLM's router would pick.
    """
    if unsupported and routing in IN_METHOD:
        raise ValueError(
            f"cpu_mxfp4: layer '{prefix}' uses {', '.join(unsupported)}, which routing={routing!r} (computed inside "
            "the method) does not implement; use routing: auto or vllm to let vLLM's router select the experts")


def order_for(routing: str, model: str | None, unsupported: list[str]) -> str:
    """``topk_softmax`` (GPT-OSS), ``softmax_topk`` (others) or ``vllm`` (vLLM's router; modular)."""
    if routing != "auto":
        return routing
    if unsupported:
        return "vllm"
    return "topk_softmax" if model == GPT_OSS else "softmax_topk"


def select_experts(order: str, top_k: int, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights ``[T, k]``, ids ``[T, k]``) from ``router_logits`` in an in-method order."""
    if order == "topk_softmax":
        weights, ids = torch.topk(router_logits, top_k, dim=-1)
        return F.softmax(weights, dim=-1, dtype=torch.float32), ids
    if order == "softmax_topk":
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), ids
    raise ValueError(f"routing order {order!r} is not computed inside the method")


def to_local(topk_ids: torch.Tensor, first_expert: int, num_local: int) -> torch.Tensor:
    """Global expert ids -> this rank's local ids (``id - first``); ids of other ranks become -1 (contribute 0)."""
    local = topk_ids.to(torch.int64) - first_expert
    if first_expert == 0 and num_local <= 0:
        return local
    return torch.where((local >= 0) & (local < num_local), local, torch.full_like(local, -1))
