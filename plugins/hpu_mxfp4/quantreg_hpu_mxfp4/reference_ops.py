"""The pure-torch reference kernels as torch custom ops, with the schemas of Gaudi's own ops.

Why: on Gaudi the fused MoE kernels are ops (``torch.ops.hpu.mixture_of_experts.*``), so a
compiled graph records one call each. The reference that stands in for them elsewhere
(:mod:`.reference`) is Python with a data-dependent loop over the routed experts (a host read of
the per-expert counts, a cache of decoded weights): traced by Dynamo, as vLLM's default mode does
(fullgraph), it fails ("Could not guard on data-dependent expression"). Registered here as
``torch.ops.quantreg_hpu_mxfp4.*`` with fake implementations (the output has the hidden states'
shape and dtype), ``mxfp4_reference`` is one opaque call per layer in a compiled graph, exactly
like the kernels it models. Importing this module registers the ops (once per process).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from quantreg.models.gpt_oss import DEFAULT_ALPHA, DEFAULT_LIMIT

from . import reference

NAMESPACE = "quantreg_hpu_mxfp4"


def _bias_mxfp4_fused_weights(
    hidden_states: torch.Tensor, expert_routing_table: torch.Tensor, router_weights: torch.Tensor,
    w12: Sequence[torch.Tensor], w3: Sequence[torch.Tensor], w12_bias: Sequence[torch.Tensor],
    w3_bias: Sequence[torch.Tensor], d_scale_w12: Sequence[torch.Tensor], d_scale_w3: Sequence[torch.Tensor], *,
    block_size: int, permuted_weights: bool, experts_min: int, experts_max: int, alpha: float = DEFAULT_ALPHA,
    limit: float = DEFAULT_LIMIT, is_fp4: bool = True, chunk_size: int = 0, total_experts: int = 0,
) -> torch.Tensor:
    """:func:`.reference.bias_mxfp4_fused_weights`, the body of the op of that name."""
    return reference.bias_mxfp4_fused_weights(
        hidden_states, expert_routing_table, router_weights, w12, w3, w12_bias, w3_bias, d_scale_w12, d_scale_w3,
        block_size=block_size, permuted_weights=permuted_weights, experts_min=experts_min, experts_max=experts_max,
        alpha=alpha, limit=limit, is_fp4=is_fp4, chunk_size=chunk_size, total_experts=total_experts)


def _mxfp4_fused_weights(
    hidden_states: torch.Tensor, expert_routing_table: torch.Tensor, router_weights: torch.Tensor,
    w12: Sequence[torch.Tensor], w3: Sequence[torch.Tensor], d_scale_w12: Sequence[torch.Tensor],
    d_scale_w3: Sequence[torch.Tensor], *, block_size: int, permuted_weights: bool, activation: str = "silu",
    experts_min: int, experts_max: int, is_fp4: bool = True, chunk_size: int = 0, total_experts: int = 0,
) -> torch.Tensor:
    """:func:`.reference.mxfp4_fused_weights`, the body of the op of that name."""
    return reference.mxfp4_fused_weights(
        hidden_states, expert_routing_table, router_weights, w12, w3, d_scale_w12, d_scale_w3,
        block_size=block_size, permuted_weights=permuted_weights, activation=activation, experts_min=experts_min,
        experts_max=experts_max, is_fp4=is_fp4, chunk_size=chunk_size, total_experts=total_experts)


def _bias_fused_weights(
    hidden_states: torch.Tensor, expert_routing_table: torch.Tensor, router_weights: torch.Tensor,
    w12: Sequence[torch.Tensor], w3: Sequence[torch.Tensor], w12_bias: Sequence[torch.Tensor],
    w3_bias: Sequence[torch.Tensor], *, permuted_weights: bool, experts_min: int, experts_max: int,
    chunk_size: int = 0, total_experts: int = 0, alpha: float = DEFAULT_ALPHA, limit: float = DEFAULT_LIMIT,
) -> torch.Tensor:
    """:func:`.reference.bias_fused_weights`, the body of the op of that name."""
    return reference.bias_fused_weights(
        hidden_states, expert_routing_table, router_weights, w12, w3, w12_bias, w3_bias,
        permuted_weights=permuted_weights, experts_min=experts_min, experts_max=experts_max, chunk_size=chunk_size,
        total_experts=total_experts, alpha=alpha, limit=limit)


def _fused_weights(
    hidden_states: torch.Tensor, expert_routing_table: torch.Tensor, router_weights: torch.Tensor,
    w12: Sequence[torch.Tensor], w3: Sequence[torch.Tensor], *, permuted_weights: bool, activation: str = "silu",
    experts_min: int, experts_max: int, chunk_size: int = 0, total_experts: int = 0,
) -> torch.Tensor:
    """:func:`.reference.fused_weights`, the body of the op of that name."""
    return reference.fused_weights(
        hidden_states, expert_routing_table, router_weights, w12, w3, permuted_weights=permuted_weights,
        activation=activation, experts_min=experts_min, experts_max=experts_max, chunk_size=chunk_size,
        total_experts=total_experts)


def _like_hidden(hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """Every reference kernel returns ``[tokens, hidden]`` in the hidden states' dtype."""
    return torch.empty_like(hidden_states)


def _register(name: str, fn: Any) -> Any:
    """``fn`` as ``torch.ops.quantreg_hpu_mxfp4.<name>`` with the fake above (by call: torch's decorator is untyped)."""
    op: Any = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=())
    op.register_fake(_like_hidden)
    return op


bias_mxfp4_fused_weights: Any = _register("bias_mxfp4_fused_weights", _bias_mxfp4_fused_weights)
mxfp4_fused_weights: Any = _register("mxfp4_fused_weights", _mxfp4_fused_weights)
bias_fused_weights: Any = _register("bias_fused_weights", _bias_fused_weights)
fused_weights: Any = _register("fused_weights", _fused_weights)
