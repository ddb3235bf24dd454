"""Expert selection and data-parallel dispatch, as vllm-gaudi's MXFP4 method does them.

Kept apart from the method class so the routing rules can be read (and tested) on their own.
What every monolithic method needs (the features softmax + top-k does not compute, the two
orders) is quantreg's documented helper :mod:`quantreg.vllm.routing`; this module holds this
method's choices (a layer's own router, the ``auto`` rule) and vllm-gaudi's DP dispatch.
"""

from __future__ import annotations

import importlib
from enum import Enum
from typing import Any

import torch

from quantreg import BuildContext
from quantreg.vllm import routing as shared
from quantreg.vllm.context import UNKNOWN_MODEL, current_model_type
from quantreg.vllm.routing import unsupported_routing as unsupported_routing  # this plugin's name for it

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


def order_for(routing: str, model_type: str | None, layer: Any, unsupported: list[str] | None = None) -> str:
    """Which routing a layer gets: ``topk_softmax``, ``softmax_topk``, ``layer_router`` or ``vllm``.

    ``vllm`` means the method is modular: vLLM's router selects experts before ``apply``. In
    ``auto`` mode that is how grouped/custom routing is honoured on vLLM 0.32, whose
    ``RoutedExperts`` no longer carries the ``router`` the seed called (``layer_router``), and how
    every feature in ``unsupported`` (:func:`unsupported_routing`) is honoured: deferred to vLLM's
    router, never approximated. An explicit in-method order with such features is refused
    (:func:`quantreg.vllm.routing.check_in_method_routing`) before this is asked.
    """
    if routing != "auto":
        return routing
    if unsupported:
        return "vllm"
    if model_type != GPT_OSS and uses_custom_routing(layer):
        return "layer_router" if hasattr(layer, "router") else "vllm"
    return shared.default_order(model_type)


def select_experts(order: str, layer: Any, x: torch.Tensor,
                   router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) for ``x`` from ``router_logits`` in the given order (not ``vllm``)."""
    if order == "layer_router":
        weights, ids = layer.router.select_experts(hidden_states=x, router_logits=router_logits)
        return weights, ids
    return shared.select_in_method(order, int(layer.top_k), router_logits)


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
