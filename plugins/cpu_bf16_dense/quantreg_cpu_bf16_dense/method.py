"""``cpu_bf16_dense_kernel``: a dense layer's bf16 weight repacked once at load for this
distribution's own kernel (:mod:`.kernel`), with the faithful path's numerics.

Built by quantreg's dense seam as ``CpuBf16DenseMethod(vllms_method)`` for a linear layer or the
lm_head whose own method is vLLM's unquantized one. Why beside vLLM's own bf16 layer: on a host
without AVX-512 BF16 vLLM-CPU cannot build its oneDNN bf16 linear and falls back to torch's bf16
GEMM, which runs at a fraction of the memory bus at one token and far below fp32 SGEMM at 512
(issue 55); this kernel is a GEMV at the bus for decode and a blocked GEMM for prefill, with fp32
products and accumulation and one bf16 rounding of the output -- no quantisation.

* ``__init__``: loads the library and checks it runs here (:func:`.kernel.require`), so a library
  that is missing, not a library, or of another ABI fails when the method is built -- where the
  seam falls back to vLLM's method (lenient) or stops in one line (strict) -- never at the first
  forward;
* ``create_weights``: vLLM's own (the checkpoint's bf16 ``weight`` [N, K] loads as without quantreg);
* ``process_weights_after_loading``: repack (:class:`.kernel.PackedWeight`) and release the
  row-major copy. A weight that is not bf16 (an fp16 / fp32 model) is left to vLLM's own method
  with one WARNING: converting it to bf16 would be a lossy step this method promises not to take;
* ``apply``: the registered op ``quantreg_cpu_bf16_dense::linear`` (bias added in the op).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from . import kernel

log = logging.getLogger("vllm.quantreg.cpu_bf16_dense")

SUPPORTED = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)


class CpuBf16DenseMethod(LinearMethodBase):  # type: ignore[misc]
    """bf16 weights in the kernel's layout, fp32 accumulation, the output rounded to bf16 once."""

    def __init__(self, vllm_method: Any) -> None:
        if not isinstance(vllm_method, SUPPORTED):
            raise TypeError(f"cpu_bf16_dense_kernel runs unquantized bf16 weights; this layer's own method is "
                            f"{type(vllm_method).__name__}, not one of {', '.join(c.__name__ for c in SUPPORTED)}")
        self.isa = kernel.require()
        self.vllm_method = vllm_method
        self.weight: kernel.PackedWeight | None = None
        self.delegated = False

    def __getattr__(self, name: str) -> Any:  # embedding(), tie_weights() for an lm_head: vLLM's own
        if name in ("vllm_method", "weight", "isa", "delegated"):
            raise AttributeError(name)
        return getattr(self.vllm_method, name)

    def create_weights(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        self.vllm_method.create_weights(layer, *args, **kwargs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight = layer.weight
        if weight.dtype != torch.bfloat16:
            log.warning("quantreg cpu_bf16_dense_kernel: %s has a %s weight, not bf16; vLLM's own method serves it "
                        "(no lossy conversion)", getattr(layer, "prefix", type(layer).__name__), weight.dtype)
            self.delegated = True
            self.vllm_method.process_weights_after_loading(layer)
            return
        self.weight = kernel.PackedWeight.from_weight(weight.data)
        layer.weight = None  # only the packed copy stays resident

    def resident_bytes(self) -> int:
        """Bytes this method keeps outside the layer's parameters (the packed bf16 weight): what a tool
        counting bytes read per token must see once the row-major weight is gone."""
        return 0 if self.weight is None else self.weight.nbytes

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.delegated:
            out: torch.Tensor = self.vllm_method.apply(layer, x, bias)
            return out
        if self.weight is None:
            raise RuntimeError("cpu_bf16_dense_kernel: apply() before process_weights_after_loading()")
        return kernel.linear(x, self.weight, bias)
