"""Helpers the kernel tests import (test_kernel.py, test_kernel_callback.py): routing, packing and
a float64 SiLU MoE; the CPU's flags for conftest.py's ``isa`` fixture. A module name of its own
(``conftest`` is not importable by name); torch and the kernel are imported where used, so
conftest.py loads in an environment without torch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from quantreg_cpu_mxfp4 import kernel

AVX512_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def routing(tokens: int, num_experts: int, top_k: int, *, seed: int,
            out_of_range: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    if out_of_range and tokens:
        ids[0, 0] = -1  # another rank's expert, below this slice
        ids[tokens // 2, top_k - 1] = num_experts + 3  # and above it
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return ids.to(torch.int32), weights


def silu_moe_f64(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor) -> torch.Tensor:
    """Mixtral-style MoE in float64: w13 = [gate; up] halves, silu(gate) * up, no biases."""
    import torch

    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            if not 0 <= e < w13.shape[0]:
                continue
            h = w13[e] @ x[t].double()
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(weights[t, s]) * (w2[e] @ a)
    return out


def pack(experts: object) -> tuple[kernel.PackedExperts, kernel.PackedExperts]:
    from quantreg_cpu_mxfp4 import kernel

    return (kernel.PackedExperts.from_vllm(experts.w13_weight, experts.w13_weight_scale),  # type: ignore[attr-defined]
            kernel.PackedExperts.from_vllm(experts.w2_weight, experts.w2_weight_scale))  # type: ignore[attr-defined]
