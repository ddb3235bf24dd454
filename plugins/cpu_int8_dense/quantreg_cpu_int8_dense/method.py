"""``cpu_int8_dense``: a dense layer's bf16 weight quantised once at load to int8, int8 GEMMs at run time.

Built by quantreg's dense seam as ``CpuInt8DenseMethod(vllms_method)`` for a linear layer or the
lm_head whose own method is vLLM's unquantized one (``UnquantizedLinearMethod`` /
``UnquantizedEmbeddingMethod``). What it does:

* ``create_weights``: vLLM's own (the checkpoint's bf16 ``weight`` [N, K] loads exactly as without
  the plugin; for the lm_head vLLM created it already);
* ``process_weights_after_loading``: per output channel, ``scale = max|w| / 127`` and
  ``q = round(w / scale)`` in float32, handed to vLLM-CPU's oneDNN W8A8 handler
  (``create_onednn_scaled_mm``, the kernel vLLM runs for W8A8 compressed-tensors checkpoints), which
  prepacks it; the bf16 weight is then released, so only the int8 copy stays resident (for
  GPT-OSS-20B's lm_head 0.58 GB instead of 1.16 GB);
* ``apply``: the activations are quantised per token (``dynamic_scaled_int8_quant``, symmetric)
  and multiplied in int8 with int32 accumulation (VNNI where the CPU has it), scaled back to the
  activations' dtype with the bias added by the same oneDNN call.

Why vLLM's kernel and not one of our own: it is maintained with vLLM-CPU, dispatches on the ISA
(AVX-512 VNNI / AMX / AVX2) and measured faster than vLLM's bf16 path at GPT-OSS-20B's shapes
(bench/dense_int8.py). Error against float64: bench/results and docs/dense.md.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm.model_executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from .quantize import quantize_per_channel

SUPPORTED = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)




class CpuInt8DenseMethod(LinearMethodBase):  # type: ignore[misc]
    """int8 per-channel weights, per-token int8 activations, oneDNN int8 GEMM."""

    def __init__(self, vllm_method: Any) -> None:
        if not isinstance(vllm_method, SUPPORTED):
            raise TypeError(f"cpu_int8_dense quantises bf16/fp16/fp32 weights; this layer's own method is "
                            f"{type(vllm_method).__name__}, not one of {', '.join(c.__name__ for c in SUPPORTED)}")
        self.vllm_method = vllm_method
        self.handler: Any = None
        self.n = 0
        self.k = 0

    def __getattr__(self, name: str) -> Any:  # embedding(), tie_weights() for an lm_head: vLLM's own
        if name in ("vllm_method", "handler", "n", "k"):
            raise AttributeError(name)
        return getattr(self.vllm_method, name)

    def create_weights(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        self.vllm_method.create_weights(layer, *args, **kwargs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight = layer.weight
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"expected a 2-D floating-point weight, got {tuple(weight.shape)} {weight.dtype}")
        q, scale = quantize_per_channel(weight.detach())
        self.n, self.k = q.shape
        self.handler = ops.create_onednn_scaled_mm(q.t(), scale, weight.dtype, True, False, 32)
        del q
        # only the int8 copy (inside the oneDNN handler) stays; the bf16 weight is released
        layer.weight = None
        layer.quantreg_int8_scale = scale  # per-channel scales, for tools and verification

    def resident_bytes(self) -> int:
        """Bytes this method keeps outside the layer's parameters: the int8 weight inside the oneDNN
        handler and the float32 per-channel scales. Tools that count what a layer reads per token
        (the whole-model bench) would otherwise see nothing once the bf16 weight is released."""
        return self.n * self.k + self.n * 4

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        xq, xs, _ = ops.onednn_scaled_int8_quant(x2, None, None, True)
        out = torch.empty((x2.shape[0], self.n), dtype=x.dtype)
        ops.onednn_scaled_mm(self.handler, xq, out, xs, None, None, bias)
        return out.reshape(*shape[:-1], self.n)
