"""quantreg hook implementations: the ``cpu_int8_dense`` and ``cpu_int8_dense_kernel`` methods
(strings only; no torch, no vLLM).

Written as a third party would: only quantreg's documented plugin API. The packaged table
``dense_int8.yaml`` is NOT registered through ``register_tables``: installing the plugin changes
no decision (the default stays faithful to the checkpoint's bf16 dense weights); an operator
turns it on by naming that table (``QUANTREG_CONFIG``) or writing its one rule in their own.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path

import quantreg

PACKAGE = "quantreg_cpu_int8_dense"
METHOD = "cpu_int8_dense"
KERNEL_METHOD = "cpu_int8_dense_kernel"
KERNEL_NUMERICS = ("weights int8 per (output row, 32-block along K) with fp16 scales, repacked once at load; "
                   "activations int8 per (token, 32-block) with fp32 scales at every call; each block's int32 dot "
                   "times both scales, accumulated in fp32 (llama.cpp's Q8_0 scheme; AVX2 and AVX-512 VNNI paths "
                   "bit-identical)")
"""What ``cpu_int8_dense_kernel`` rounds, per what block (its registration's ``numerics``; ``kernel.NUMERICS``)."""


def table_path() -> Path:
    """The opt-in table shipped with the plugin (``QUANTREG_CONFIG=$(python -m quantreg_cpu_int8_dense)``)."""
    return Path(str(resources.files(PACKAGE).joinpath("dense_int8.yaml")))


@quantreg.hookimpl
def register_methods(register: Callable[[quantreg.Method], None]) -> None:
    register(quantreg.Method(
        name=METHOD,
        target=f"{PACKAGE}.method:CpuInt8DenseMethod",
        devices=("cpu",),
        requires=("torch", "vllm"),
        # VNNI (EVEX or VEX form): without it oneDNN's int8 GEMM multiplies u8 x s8 with vpmaddubsw,
        # whose int16 pair sums saturate -- relative error 0.11-0.14 measured on an AVX2-only host,
        # against the kit's 0.02 (issue 46, class 3). Such a host is passed over by this declaration.
        host=("cpu:avx512_vnni|avx_vnni",),
        probe=f"{PACKAGE}.probe:ops_available",
        options=(),
        layers=("attention", "dense", "lm_head"),
        description="bf16 dense weights quantised once at load to int8 per output channel, activations per token, "
                    "vLLM-CPU's oneDNN W8A8 GEMM (VNNI where present)",
        # oneDNN's W8A8 takes one activation scale per token (or per tensor): it cannot block-scale,
        # so its error exceeds a Q8_0 emulation's (1.6x on Gaussian activations, 7x with two channels
        # at 100x the rest) and no shipped table offers it (issue 54).
        numerics="weights int8 per output row (one fp32 scale per K values); activations int8 per token (one scale "
                 "for all K); int32 dot scaled once -- coarser than llama.cpp's Q8_0 when a few activation "
                 "channels are large",
    ))
    register(quantreg.Method(
        name=KERNEL_METHOD,
        target=f"{PACKAGE}.kernel_method:CpuInt8KernelDenseMethod",
        devices=("cpu",),
        requires=("torch", "vllm"),
        # the kernel's baseline path (F16C: its fp16 block scales); AVX-512 VNNI is taken at run time where present
        host=("cpu:avx2", "cpu:fma", "cpu:f16c"),
        probe=f"{PACKAGE}.probe:kernel_available",
        options=(),
        layers=("attention", "dense", "lm_head"),
        description="bf16 dense weights quantised once at load to int8 per 32-block (Q8_0's scheme), activations "
                    "per 32-block, this plugin's int8 GEMV kernel (AVX2 without saturation, or AVX-512 VNNI), any "
                    "x86-64 CPU",
        numerics=KERNEL_NUMERICS,
    ))
