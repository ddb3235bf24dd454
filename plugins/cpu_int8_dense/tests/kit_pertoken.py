"""A TEST-ONLY dense method that rounds activations per token (one int8 scale for all K) and weights
per output row -- the scheme ``cpu_int8_dense_kernel`` used before issue 54 and vLLM's oneDNN W8A8
uses. Registered by nothing, offered by no table: ``test_heavy_tailed_kit.py`` hands it to the kit to
show that the heavy-tailed check fails it, located. Pure torch, exact integer dots in float64, so
what it computes is that scheme and nothing else."""

from __future__ import annotations

from typing import Any

import torch
from quantreg_cpu_int8_dense.quantize import quantize_per_channel
from vllm.model_executor.layers.linear import LinearMethodBase


class PerTokenInt8DenseMethod(LinearMethodBase):  # type: ignore[misc]
    """int8 weights per output row, int8 activations per token, exact dots, one scale product per output."""

    def __init__(self, vllm_method: Any) -> None:
        self.vllm_method = vllm_method
        self.q: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None

    def create_weights(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        self.vllm_method.create_weights(layer, *args, **kwargs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.q, self.scale = quantize_per_channel(layer.weight.detach())

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        assert self.q is not None and self.scale is not None
        xf = x.float().reshape(-1, x.shape[-1])
        s = xf.abs().amax(dim=1, keepdim=True) / 127.0
        xq = torch.where(s > 0, torch.round(xf / s.clamp(min=1e-30)), 0.0).clamp(-127, 127)
        out = (xq.double() @ self.q.double().t()) * s.double() * self.scale.double()
        if bias is not None:
            out = out + bias.double()
        return out.to(x.dtype).reshape(*x.shape[:-1], self.q.shape[0])
