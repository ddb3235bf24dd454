"""GPT-OSS's MoE block on MXFP4 experts, in float64: the math every GPT-OSS MXFP4 method must compute.

One written-down definition that plugins, the conformance kit (:mod:`quantreg.testing`) and their
tests share, so "correct" means the same thing everywhere. It follows the checkpoint format and
vLLM's GPT-OSS model, not any kernel:

* **Routing**: top-k of the router logits, then softmax over those k (for distinct logits this
  equals vLLM's ``renormalize=True`` router: softmax over all experts, top-k, renormalise).
* **w13** ``[E, 2I, H]`` holds gate and up **interleaved**: gate = rows ``0::2``, up = rows
  ``1::2``; its bias is added before the activation.
* **SwiGLU-OAI**: ``gate = clamp(g, max=limit)``, ``up = clamp(u, -limit, limit)``,
  ``out = (up + 1) * gate * sigmoid(alpha * gate)`` (alpha and limit from :mod:`quantreg.models.gpt_oss`).
* **w2** ``[E, H, I]`` and its bias, per expert, *before* the routing weight: a token's output is
  ``sum_k weight_k * (w2[e_k] @ act + b2[e_k])``.
* **Expert parallelism**: a rank holding global experts ``experts_min .. experts_min + E_local - 1``
  computes only those; routed ids outside that range contribute nothing (the ranks' partial sums
  add up to the full output).

Weights are stored as vLLM's parameters hold them (:mod:`quantreg.formats.mxfp4` layout: uint8
blocks ``[..., N, K/2]``, E8M0 scales ``[..., N, K/32]``) with bf16 biases;
:func:`reference_moe_block` reads a whole layer (router included) from checkpoint tensors instead.
Importing this module imports torch; ``import quantreg`` does not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..error_measure import relative_error
from ..formats.mxfp4 import BLOCK_SIZE, dequantize_mxfp4_f64, random_mxfp4
from .gpt_oss import DEFAULT_ALPHA, DEFAULT_LIMIT, PARAMETERS

__all__ = [
    "DEFAULT_ALPHA", "DEFAULT_LIMIT", "PARAMETERS", "GptOssMxfp4Experts", "moe_f64", "random_gpt_oss_mxfp4_experts",
    "random_hidden_states", "random_router_logits", "reference_moe_block", "relative_error", "route_topk_softmax",
    "swiglu_oai",
]


def route_topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS routing: (float64 weights ``[T, k]``, int64 ids ``[T, k]``), softmax over the top k logits."""
    values, ids = torch.topk(router_logits.double(), top_k, dim=-1)
    return torch.softmax(values, dim=-1), ids


def swiglu_oai(h: torch.Tensor, alpha: float = DEFAULT_ALPHA, limit: float = DEFAULT_LIMIT) -> torch.Tensor:
    """SwiGLU-OAI over interleaved ``[..., 2I]`` pre-activations: ``[..., I]``."""
    gate = h[..., 0::2].clamp(max=limit)
    up = h[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """SiLU-and-mul over the same interleaved pre-activations (``silu(gate) * up``, no alpha, clamp or +1).

    Not GPT-OSS's activation: it is what vLLM's ``fused_experts_cpu`` computes with its default
    ``act_method`` (SiLU) since 0.33, so a kernel or oracle called with the defaults computes this
    without an error. The kit's diagnosis names it (:mod:`quantreg.testing.diagnose`).
    """
    gate, up = h[..., 0::2], h[..., 1::2]
    return up * gate * torch.sigmoid(gate)


#: Activations the reference computes: GPT-OSS's (``swigluoai``) and the default others fall back to.
ACTIVATIONS = ("swigluoai", "silu")


def moe_f64(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    *,
    experts_min: int = 0,
    alpha: float = DEFAULT_ALPHA,
    limit: float = DEFAULT_LIMIT,
    activation: str = "swigluoai",
) -> torch.Tensor:
    """The GPT-OSS MoE block in float64 from dense expert weights; returns ``[T, H]`` float64.

    ``activation``: ``swigluoai`` (GPT-OSS, the default) or ``silu`` (:func:`silu_and_mul`, what a
    kernel called with vLLM's default ``act_method`` computes: the kit's diagnosis compares with it).

    ``w13`` ``[E_local, 2I, H]`` and ``w2`` ``[E_local, H, I]`` are the local experts, global ids
    ``experts_min ..``; ``topk_ids`` hold global ids and ids outside the local range are skipped.
    Biases (``[E_local, 2I]``, ``[E_local, H]``) may be ``None`` (zero).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: expected one of {', '.join(ACTIVATIONS)}")
    if x.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must be [T, H], [T, k], [T, k]")
    return moe_f64_by_expert(x, topk_ids, topk_weights, w13.shape[0], lambda e: (w13[e], w2[e]),
                             w13_bias, w2_bias, experts_min=experts_min, alpha=alpha, limit=limit,
                             activation=activation)


def moe_f64_by_expert(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_local: int,
    expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    *,
    experts_min: int = 0,
    alpha: float = DEFAULT_ALPHA,
    limit: float = DEFAULT_LIMIT,
    activation: str = "swigluoai",
) -> torch.Tensor:
    """:func:`moe_f64` with each local expert's ``(w13, w2)`` asked of ``expert(e)``, only for experts
    some token is routed to: ``against: float64`` inside vLLM decodes MXFP4 experts one at a time
    (a whole 120B layer in float64 would not fit), and this stays the one float64 MoE block."""
    xd = x.double()
    out = torch.zeros(xd.shape[0], xd.shape[1], dtype=torch.float64, device=x.device)
    local = topk_ids.long() - experts_min
    for e in range(num_local):
        tokens, slots = (local == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        w13, w2 = expert(e)
        h = xd[tokens] @ w13.double().T
        if w13_bias is not None:
            h = h + w13_bias[e].double()
        act = swiglu_oai(h, alpha, limit) if activation == "swigluoai" else silu_and_mul(h)
        y = act @ w2.double().T
        if w2_bias is not None:
            y = y + w2_bias[e].double()
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].double().unsqueeze(1))
    return out


@dataclass(frozen=True)
class GptOssMxfp4Experts:
    """A GPT-OSS MoE layer's experts as vLLM's MXFP4 parameters hold them (global expert order).

    ``w13_weight`` uint8 ``[E, 2I, H/2]``, ``w13_weight_scale`` uint8 ``[E, 2I, H/32]``,
    ``w2_weight`` uint8 ``[E, H, I/2]``, ``w2_weight_scale`` uint8 ``[E, H, I/32]``, biases bf16
    ``[E, 2I]`` / ``[E, H]`` or ``None``. These are exactly the tensors vLLM's GPT-OSS loader hands
    to the parameters' ``weight_loader`` (checkpoint blocks ``[E, N, K/32, 16]`` viewed flat).
    """

    w13_weight: torch.Tensor
    w13_weight_scale: torch.Tensor
    w2_weight: torch.Tensor
    w2_weight_scale: torch.Tensor
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return int(self.w13_weight.shape[0])

    @property
    def hidden(self) -> int:
        return int(self.w13_weight.shape[2]) * 2

    @property
    def intermediate(self) -> int:
        return int(self.w13_weight.shape[1]) // 2

    @property
    def has_bias(self) -> bool:
        return self.w13_bias is not None and self.w2_bias is not None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Parameter name -> tensor, for the names present (see :data:`PARAMETERS`)."""
        return {name: t for name in PARAMETERS if (t := getattr(self, name)) is not None}

    def slice(self, start: int, stop: int) -> GptOssMxfp4Experts:
        """Experts ``start .. stop - 1``: what an expert-parallel rank loads."""
        return GptOssMxfp4Experts(**{name: t[start:stop] for name, t in self.tensors().items()})

    def dense_f64(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact float64 decode: (w13 ``[E, 2I, H]``, w2 ``[E, H, I]``)."""
        return (dequantize_mxfp4_f64(self.w13_weight, self.w13_weight_scale),
                dequantize_mxfp4_f64(self.w2_weight, self.w2_weight_scale))

    def reference(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        experts_min: int = 0,
        alpha: float = DEFAULT_ALPHA,
        limit: float = DEFAULT_LIMIT,
        activation: str = "swigluoai",
    ) -> torch.Tensor:
        """:func:`moe_f64` with these experts as global experts ``experts_min ..``."""
        w13, w2 = self.dense_f64()
        return moe_f64(x, topk_ids, topk_weights, w13, w2, self.w13_bias, self.w2_bias,
                       experts_min=experts_min, alpha=alpha, limit=limit, activation=activation)


def random_gpt_oss_mxfp4_experts(
    num_experts: int,
    hidden: int,
    intermediate: int,
    *,
    bias: bool,
    seed: int,
    scale_range: tuple[int, int] = (118, 122),
    clamped_rows: int = 1,
    limit: float = DEFAULT_LIMIT,
) -> GptOssMxfp4Experts:
    """Valid random GPT-OSS MXFP4 experts whose outputs depend on every part of the math.

    Scale bytes 118..122 (2**-9 .. 2**-5) keep pre-activations of a unit-variance input O(1), so
    gate and up both matter and bf16 rounding stays far below any real mistake. With ``bias``,
    ``clamped_rows`` gate rows and up rows per expert get biases beyond ``limit`` (alternating
    sign for up) so a method that forgets the SwiGLU clamps is seen; the other biases are
    ``N(0, 0.5)``. Measured on 8 x 64 x 96 experts: each classic mistake (swapped nibbles,
    concatenated gate/up, a dropped or unweighted bias, no clamp, no renormalisation) moves the
    output by 15 % to 280 % of its largest value, against ~0.5 % for bf16 rounding.
    """
    if hidden % BLOCK_SIZE or intermediate % BLOCK_SIZE:
        raise ValueError(f"hidden ({hidden}) and intermediate ({intermediate}) must be multiples of {BLOCK_SIZE}")
    w13, w13_scale = random_mxfp4((num_experts, 2 * intermediate, hidden), seed=seed, scale_range=scale_range)
    w2, w2_scale = random_mxfp4((num_experts, hidden, intermediate), seed=seed + 1, scale_range=scale_range)
    if not bias:
        return GptOssMxfp4Experts(w13, w13_scale, w2, w2_scale)
    g = torch.Generator().manual_seed(seed + 2)
    b13 = torch.randn(num_experts, 2 * intermediate, generator=g) * 0.5
    b2 = torch.randn(num_experts, hidden, generator=g) * 0.5
    beyond = math.ceil(limit) + 2.0
    for e in range(num_experts):
        rows = torch.randperm(intermediate, generator=g)[:clamped_rows]
        for i, r in enumerate(rows.tolist()):
            b13[e, 2 * r] = beyond  # a gate row above the limit
            b13[e, 2 * r + 1] = beyond if i % 2 == 0 else -beyond  # its up row beyond +-limit
    return GptOssMxfp4Experts(w13, w13_scale, w2, w2_scale, b13.to(torch.bfloat16), b2.to(torch.bfloat16))


def random_router_logits(tokens: int, num_experts: int, *, seed: int) -> torch.Tensor:
    """bf16 router logits ``[T, E]`` with distinct, well separated values in every row.

    Ties in top-k make the chosen experts depend on the kernel's tie-breaking, which is not
    part of the math; each row is a random permutation of ``offset + step * (0..E-1)`` with
    ``step`` in {0.25, 0.5, 0.75} and ``offset`` a multiple of 0.25, all exact in bf16.
    """
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(tokens):
        step = 0.25 * float(torch.randint(1, 4, (1,), generator=g))
        offset = 0.25 * float(torch.randint(-8, 1, (1,), generator=g))
        rows.append(torch.randperm(num_experts, generator=g).double() * step + offset)
    return torch.stack(rows).to(torch.bfloat16) if rows else torch.empty(0, num_experts, dtype=torch.bfloat16)


def random_hidden_states(tokens: int, hidden: int, *, seed: int) -> torch.Tensor:
    """bf16 ``[T, H]`` unit-variance inputs, roughly what a post-attention RMSNorm hands the MoE."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)


def reference_moe_block(
    tensors: dict[str, torch.Tensor],
    layer: int,
    x: torch.Tensor,
    *,
    top_k: int = 2,
    alpha: float = DEFAULT_ALPHA,
    limit: float = DEFAULT_LIMIT,
) -> torch.Tensor:
    """The GPT-OSS MLP block (router + experts) of ``model.layers.{layer}`` from checkpoint tensors.

    Why: an oracle for what vLLM (with any MoE method) must compute on a whole checkpoint layer,
    from the Hugging Face tensors rather than any kernel's parameters. Accepts the MXFP4 layout
    (``*_blocks`` ``[E, N, K/32, 16]`` + ``*_scales``) or the bf16 twin (``gate_up_proj``
    ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``). The router logits are computed in fp32 (so the
    experts chosen are those of an fp32 router), then :func:`route_topk_softmax` and
    :func:`moe_f64`. ``x`` is ``[T, H]``; returns ``[T, H]`` fp32.
    """
    p = f"model.layers.{layer}.mlp."
    e = p + "experts."
    if e + "gate_up_proj_blocks" in tensors:
        w13 = dequantize_mxfp4_f64(tensors[e + "gate_up_proj_blocks"], tensors[e + "gate_up_proj_scales"])
        w2 = dequantize_mxfp4_f64(tensors[e + "down_proj_blocks"], tensors[e + "down_proj_scales"])
    else:  # bf16 twin: [E, H, 2I] / [E, I, H]
        w13 = tensors[e + "gate_up_proj"].double().transpose(1, 2)
        w2 = tensors[e + "down_proj"].double().transpose(1, 2)
    logits = x.float() @ tensors[p + "router.weight"].float().T + tensors[p + "router.bias"].float()
    weights, ids = route_topk_softmax(logits, top_k)
    out = moe_f64(x, ids, weights, w13, w2, tensors[e + "gate_up_proj_bias"], tensors[e + "down_proj_bias"],
                  alpha=alpha, limit=limit)
    return out.float()
