"""Shared test helpers: random MoE weights, a float64 oracle, layers built by the real method.

Kept import-light (no vLLM at import) so the fast tests stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quantreg.formats.mxfp4 import dequantize_mxfp4_f64, random_mxfp4

ALPHA, LIMIT = 1.702, 7.0


@dataclass
class Experts:
    """Per-local-expert packed weights (vLLM layout) and biases."""

    w13: torch.Tensor  # uint8 [E, 2I, H/2]
    w13_scale: torch.Tensor  # uint8 [E, 2I, H/32]
    w2: torch.Tensor  # uint8 [E, H, I/2]
    w2_scale: torch.Tensor  # uint8 [E, H, I/32]
    w13_bias: torch.Tensor | None  # bf16 [E, 2I]
    w2_bias: torch.Tensor | None  # bf16 [E, H]

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def lists(self) -> dict[str, tuple[torch.Tensor, ...]]:
        out = {
            "w12": tuple(self.w13), "w3": tuple(self.w2),
            "d_scale_w12": tuple(self.w13_scale), "d_scale_w3": tuple(self.w2_scale),
        }
        if self.w13_bias is not None and self.w2_bias is not None:
            out["w12_bias"] = tuple(self.w13_bias)
            out["w3_bias"] = tuple(self.w2_bias)
        return out


def make_experts(num_experts: int, hidden: int, intermediate: int, *, bias: bool, seed: int,
                 scale_range: tuple[int, int] = (118, 122)) -> Experts:
    """Random valid MXFP4 experts; the scale range keeps activations well inside the SwiGLU clamp."""
    w13, w13_scale = random_mxfp4((num_experts, 2 * intermediate, hidden), seed=seed, scale_range=scale_range)
    w2, w2_scale = random_mxfp4((num_experts, hidden, intermediate), seed=seed + 1, scale_range=scale_range)
    g = torch.Generator().manual_seed(seed + 2)
    b13 = (torch.randn(num_experts, 2 * intermediate, generator=g) * 0.5).to(torch.bfloat16) if bias else None
    b2 = (torch.randn(num_experts, hidden, generator=g) * 0.5).to(torch.bfloat16) if bias else None
    return Experts(w13, w13_scale, w2, w2_scale, b13, b2)


def make_tokens(tokens: int, hidden: int, num_global: int, top_k: int, *, seed: int,
                id_low: int = 0, id_high: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 hidden states, distinct global expert ids per token (int32), bf16 routing weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    high = num_global if id_high is None else id_high
    ids = torch.stack([torch.randperm(high - id_low, generator=g)[:top_k] + id_low for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1).to(torch.bfloat16)
    return x, ids.to(torch.int32), weights


def oracle(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts, experts_min: int, *,
           activation: str = "swigluoai", alpha: float = ALPHA, limit: float = LIMIT) -> torch.Tensor:
    """Float64 evaluation from the definition (bias => SwiGLU-OAI on interleaved rows)."""
    w13 = dequantize_mxfp4_f64(experts.w13, experts.w13_scale)
    w2 = dequantize_mxfp4_f64(experts.w2, experts.w2_scale)
    xd = x.double()
    out = torch.zeros_like(xd)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot]) - experts_min
            if not 0 <= e < experts.num_experts:
                continue
            h = w13[e] @ xd[t]
            if experts.w13_bias is not None:
                h = h + experts.w13_bias[e].double()
            if activation == "swigluoai":
                gate, up = h[0::2].clamp(max=limit), h[1::2].clamp(-limit, limit)
                a = (up + 1) * gate * torch.sigmoid(alpha * gate)
            else:
                half = h.shape[0] // 2
                act = {"silu": torch.nn.functional.silu, "relu": torch.relu,
                       "gelu": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}[activation]
                a = act(h[:half]) * h[half:]
            y = w2[e] @ a
            if experts.w2_bias is not None:
                y = y + experts.w2_bias[e].double()
            out[t] += float(weights[t, slot]) * y
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|: the tolerance measure used throughout."""
    scale = ref.abs().max().item()
    return (out.double() - ref).abs().max().item() / (scale if scale > 0 else 1.0)


def moe_config(*, num_global: int, num_local: int, top_k: int, hidden: int, intermediate: int, bias: bool,
               activation: str = "swigluoai", ep_rank: int = 0, dp_size: int = 1) -> Any:
    """A real vLLM FusedMoEConfig for a layer slice (EP rank ``ep_rank`` of ``num_global/num_local``)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    ep_size = num_global // num_local
    parallel = FusedMoEParallelConfig(
        tp_size=1, pcp_size=1, dp_size=dp_size, ep_size=ep_size, tp_rank=0, pcp_rank=0, dp_rank=0,
        ep_rank=ep_rank, sp_size=1, use_ep=ep_size > 1, all2all_backend="naive", enable_eplb=False,
    )
    return FusedMoEConfig(
        num_experts=num_global, experts_per_token=top_k, hidden_dim=hidden, intermediate_size=intermediate,
        num_local_experts=num_local, num_logical_experts=num_global, activation=MoEActivation(activation),
        device="cpu", routing_method=RoutingMethodType.Renormalize, moe_parallel_config=parallel,
        in_dtype=torch.bfloat16, has_bias=bias,
    )


class FakeLayer(torch.nn.Module):
    """The attributes vLLM's ``RoutedExperts`` gives a quant method, parameters made by the method.

    With ``experts``, they are loaded and ``process_weights_after_loading`` runs; with ``None``
    they are left as allocated and the caller drives the method (``bench/pwal_bench.py``).
    """

    def __init__(self, method: Any, config: Any, experts: Experts | None, *, use_grouped_topk: bool = False) -> None:
        super().__init__()
        self.moe_config = config
        self.local_num_experts = config.num_local_experts
        self.global_num_experts = config.num_experts
        self.top_k = config.experts_per_token
        self.activation = config.activation
        self.use_grouped_topk = use_grouped_topk
        self.custom_routing_function = None
        method.create_weights(self, num_experts=config.num_local_experts, hidden_size=config.hidden_dim,
                              intermediate_size_per_partition=config.intermediate_size_per_partition,
                              params_dtype=torch.bfloat16)
        self.quant_method = method
        if experts is None:
            return
        for param, source in (("w13_weight", experts.w13), ("w13_weight_scale", experts.w13_scale),
                              ("w2_weight", experts.w2), ("w2_weight_scale", experts.w2_scale)):
            getattr(self, param).data.copy_(source)
        if experts.w13_bias is not None:
            self.w13_bias.data.copy_(experts.w13_bias)
            self.w2_bias.data.copy_(experts.w2_bias)
        method.process_weights_after_loading(self)
