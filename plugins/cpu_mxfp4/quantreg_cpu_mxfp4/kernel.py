"""The kernel API of quantreg-cpu-mxfp4, here as a pure-torch STAND-IN.

Why a stand-in: the compiled kernel (C++ built as a torch extension, AVX2+FMA baseline and an
AVX-512 variant) is written separately and replaces this one module, and only this module, when
it lands. Everything else in the plugin codes against the API below and nothing imports this
module's internals, so the swap changes speed, not behaviour:

* :func:`status` -- ``(True, isa)`` when the kernel can run, ``(False, why)`` otherwise; never raises;
* :func:`isa` -- the instruction-set path in use; ``QUANTREG_CPU_MXFP4_ISA=avx2`` forces the baseline;
* :class:`PackedExperts` -- one projection's experts, packed (built once from vLLM's loaded
  parameters, which the caller may then free);
* :func:`moe_forward` -- the routed experts of a MoE layer on ``[T, H]`` bf16 tokens.

This stand-in decodes each routed expert exactly to bf16 (:func:`quantreg.formats.mxfp4.dequantize_mxfp4`)
for the duration of its matmul only, so the resident weights stay the packed bytes; matmuls run
in bf16 with fp32 accumulation, activations and the weighted sum in fp32.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from quantreg.formats.mxfp4 import BLOCK_SIZE, dequantize_mxfp4

ISA_ENV = "QUANTREG_CPU_MXFP4_ISA"
ISAS = ("avx512", "avx2")


def status() -> tuple[bool, str]:
    """Whether the kernel can run here, and on which path (the stand-in: always, in torch)."""
    return True, "torch-stand-in"


def isa() -> str:
    """``avx512`` or ``avx2``: the path :func:`moe_forward` takes (``QUANTREG_CPU_MXFP4_ISA`` forces one)."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    return "avx2" if forced == "avx2" else "avx512"


class PackedExperts:
    """One projection of a layer's local experts: MXFP4 blocks uint8 ``[E, N, K/2]`` + E8M0 scales ``[E, N, K/32]``."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        self._blocks = blocks
        self._scales = scales
        self.num_experts, self.rows = int(blocks.shape[0]), int(blocks.shape[1])
        self.cols = int(blocks.shape[2]) * 2
        self.nbytes = blocks.numel() * blocks.element_size() + scales.numel() * scales.element_size()

    @classmethod
    def from_vllm(cls, blocks: torch.Tensor, scales: torch.Tensor) -> PackedExperts:
        """From vLLM's loaded parameters (the stand-in keeps them as they are: no copy)."""
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise TypeError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
        if blocks.dim() != 3 or scales.dim() != 3 or blocks.shape[:2] != scales.shape[:2] \
                or blocks.shape[2] * 2 != scales.shape[2] * BLOCK_SIZE:
            raise ValueError(f"expected blocks [E, N, K/2] and scales [E, N, K/32], got {tuple(blocks.shape)} "
                             f"and {tuple(scales.shape)}")
        return cls(blocks.detach().contiguous(), scales.detach().contiguous())

    def _dense(self, expert: int) -> torch.Tensor:
        return dequantize_mxfp4(self._blocks[expert], self._scales[expert])


def moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                w13: PackedExperts, w13_bias: torch.Tensor | None,
                w2: PackedExperts, w2_bias: torch.Tensor | None, *,
                activation: str = "swigluoai", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """``sum_k w[t,k] * expert_{id[t,k]}(x[t])`` for local expert ids (others contribute 0), bf16 ``[T, H]``.

    ``swigluoai``: interleaved gate/up rows of w13 (gate 0::2, up 1::2), GPT-OSS's clamped SwiGLU;
    ``silu``: concatenated halves ``[gate; up]``, ``silu(gate) * up``.
    """
    if activation not in ("swigluoai", "silu"):
        raise ValueError(f"activation {activation!r} is not computed (swigluoai or silu)")
    tokens = x.shape[0]
    out = torch.zeros(tokens, w2.rows, dtype=torch.float32, device=x.device)
    ids = topk_ids.to(torch.int64)
    weights = topk_weights.float()
    for e in torch.unique(ids).tolist():
        if not 0 <= e < w13.num_experts:
            continue
        token, slot = (ids == e).nonzero(as_tuple=True)
        xs = x[token].to(torch.bfloat16)
        h = (xs @ w13._dense(e).t()).float()
        if w13_bias is not None:
            h = h + w13_bias[e].float()
        if activation == "swigluoai":
            gate = h[:, 0::2].clamp(max=limit)
            up = h[:, 1::2].clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(alpha * gate)
        else:
            half = h.shape[1] // 2
            act = F.silu(h[:, :half]) * h[:, half:]
        y = (act.to(torch.bfloat16) @ w2._dense(e).t()).float()
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        out.index_add_(0, token, y * weights[token, slot].unsqueeze(1))
    return out.to(torch.bfloat16)
