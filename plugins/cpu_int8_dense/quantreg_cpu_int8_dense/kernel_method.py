"""``cpu_int8_dense_kernel``: a dense layer's bf16 weight quantised once at load to int8 per (output
row, 32-block along K) -- llama.cpp's Q8_0 scheme, activations per 32-block too -- and repacked for
this distribution's own kernel (:mod:`.kernel`), exact in int32 per block on every x86-64 kind
(AVX2, AVX-512 VNNI).

Built by quantreg's dense seam as ``CpuInt8KernelDenseMethod(vllms_method)`` for a linear layer or
the lm_head whose own method is vLLM's unquantized one. Why beside ``cpu_int8_dense`` (vLLM's oneDNN
int8 GEMM): that one is wrong without VNNI (it saturates) and reads its int8 weight at a fraction
of the memory bus at one token (issue 44); this kernel is a GEMV at the bus's speed with a
non-saturating AVX2 path.

* ``__init__``: loads the library and checks it runs here (:func:`.kernel.require`), so a library
  that is missing, not a library, or of another ABI fails when the method is built -- where the
  seam falls back to vLLM's method (lenient) or stops in one line (strict) -- never at the first
  forward (issue 46, class 2);
* ``create_weights``: vLLM's own (the checkpoint's bf16 ``weight`` [N, K] loads as without quantreg);
* ``process_weights_after_loading``: quantise and repack (:class:`.kernel.PackedWeight`); the bf16
  weight is released, only the int8 copy stays resident;
* ``apply``: the registered op ``quantreg_cpu_int8_dense::linear`` (bias added in the op).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearMethodBase

from . import kernel
from .method import SUPPORTED


class CpuInt8KernelDenseMethod(LinearMethodBase):  # type: ignore[misc]
    """int8 weights and activations per 32-block along K (Q8_0's scheme), int32 block dots, fp32 sums."""

    def __init__(self, vllm_method: Any) -> None:
        if not isinstance(vllm_method, SUPPORTED):
            raise TypeError(f"cpu_int8_dense_kernel quantises bf16/fp16/fp32 weights; this layer's own method is "
                            f"{type(vllm_method).__name__}, not one of {', '.join(c.__name__ for c in SUPPORTED)}")
        self.isa = kernel.require()
        self.vllm_method = vllm_method
        self.weight: kernel.PackedWeight | None = None

    def __getattr__(self, name: str) -> Any:  # embedding(), tie_weights() for an lm_head: vLLM's own
        if name in ("vllm_method", "weight", "isa"):
            raise AttributeError(name)
        return getattr(self.vllm_method, name)

    def create_weights(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        self.vllm_method.create_weights(layer, *args, **kwargs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.weight = kernel.PackedWeight.from_weight(layer.weight)
        # only the int8 copy (and its block scales) stays; the bf16 weight is released
        layer.weight = None

    def resident_bytes(self) -> int:
        """Bytes this method keeps outside the layer's parameters (the packed int8 weight, its scales
        and row sums): what a tool counting bytes read per token must see once the bf16 weight is gone."""
        return 0 if self.weight is None else self.weight.nbytes

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.weight is None:
            raise RuntimeError("cpu_int8_dense_kernel: apply() before process_weights_after_loading()")
        return kernel.linear(x, self.weight, bias)
