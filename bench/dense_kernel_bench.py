"""The plugin's int8 dense kernel (``cpu_int8_dense_kernel``) alone, at GPT-OSS-20B's dense shapes (issue 44).

Per shape (qkv 2880->5120, o_proj 4096->2880; the lm_head 2880->201088 at 1 token only, unless
``--lm-head-prefill``) and token count (1, 512), in interleaved rounds in one process:

* ``kernel-avx512`` / ``kernel-avx2``: :func:`quantreg_cpu_int8_dense.kernel.linear` on each ISA path
  (AVX2 forced with ``QUANTREG_CPU_INT8_DENSE_ISA``; AVX-512 VNNI only where the CPU has it);
* ``onednn-int8``: vLLM-CPU's oneDNN W8A8 GEMM through the plugin's ``cpu_int8_dense`` (what it
  runs; its numbers on a host without VNNI are wrong, it saturates, and are marked so);
* ``torch-bf16`` / ``torch-fp32``: ``torch.nn.functional.linear`` on the bf16 / fp32 weight.

The read floor: the kernel's bytes per call (the packed int8 weight, its scales and row sums) over
this machine's read bandwidth, measured here as bench/ does (``bench/read_floor.py``: a threaded
read pass over 1 GiB, the fastest of 5). At 1 token each method cycles through enough copies of
its weight that together they exceed the last-level cache, so every call reads from memory.

Rounds: ``--rounds`` (>= 3) interleaved rounds, each the median of ``--reps`` calls per method; the
JSON holds every round, the median and the spread (max/min), and flags a method whose rounds
disagree by more than :data:`SPREAD_FLAG`. The machine is shared: ``uptime``'s load averages before
and after are in the JSON (a quiet re-run is the one to quote).

    python bench/dense_kernel_bench.py [--rounds 3] [--json bench/results/dense_kernel.json]
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cli_args import Parser, whole, whole_list
from bench.dense_int8_bench import error_vs_float64, median_ms

SHAPES = {"attention qkv_proj": (2880, 5120), "attention o_proj": (4096, 2880), "lm_head": (2880, 201088)}
SPREAD_FLAG = 1.5
LLC_BYTES = 256 << 20
"""Bytes of weight copies cycled through at 1 token (well past any last-level cache here)."""


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return ""


def read_bandwidth() -> float:
    """Bytes per second of a threaded read pass over 1 GiB, the fastest of 5 (bench/read_floor.py)."""
    import torch

    from bench.read_floor import read_pass

    buf = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        read_pass([buf])
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best


class Cycle:
    """Calls ``fns`` in turn: each call reads a different copy of the weight."""

    def __init__(self, fns: list[Callable[[], Any]]) -> None:
        self.fns, self.i = fns, 0

    def __call__(self) -> Any:
        fn = self.fns[self.i]
        self.i = (self.i + 1) % len(self.fns)
        return fn()


def build(name: str, w: Any, copies: int) -> tuple[Callable[[Any], Callable[[], Any]], int]:
    """(x -> a zero-argument call cycling over ``copies`` copies of the weight, bytes per call)."""
    import torch
    from quantreg_cpu_int8_dense import kernel

    if name.startswith("kernel-"):
        isa = name.split("-", 1)[1]
        packs = [kernel.PackedWeight.from_weight(w) for _ in range(copies)]

        def kernel_call(x: Any, pw: Any) -> Any:
            os.environ["QUANTREG_CPU_INT8_DENSE_ISA"] = isa
            return kernel.linear(x, pw)

        return (lambda x: Cycle([functools.partial(kernel_call, x, pw) for pw in packs])), packs[0].nbytes
    if name == "onednn-int8":
        from quantreg_cpu_int8_dense.method import CpuInt8DenseMethod
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        layers = []
        for _ in range(copies):
            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
            method = CpuInt8DenseMethod(UnquantizedLinearMethod())
            method.process_weights_after_loading(layer)
            layers.append((method, layer))
        return ((lambda x: Cycle([functools.partial(m.apply, layer, x) for m, layer in layers])),
                layers[0][0].resident_bytes())
    dtype = torch.bfloat16 if name == "torch-bf16" else torch.float32
    weights = [w.to(dtype).clone() for _ in range(copies)]

    def make(x: Any) -> Cycle:
        xd = x.to(dtype)
        return Cycle([functools.partial(torch.nn.functional.linear, xd, wc) for wc in weights])

    return make, weights[0].numel() * weights[0].element_size()


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=whole(3, 1000), default=3)
    parser.add_argument("--reps", type=whole(1, 100_000), default=7)
    parser.add_argument("--tokens", type=whole_list(1, 65536), default=[1, 512])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--lm-head-prefill", action="store_true", help="also the lm_head at many tokens (slow)")
    parser.add_argument("--json")
    args = parser.parse_args()
    import torch
    from quantreg_cpu_int8_dense import kernel

    from quantreg.host import host_facts

    up_before = _uptime()
    load_before = os.getloadavg()
    bandwidth = read_bandwidth()
    facts = host_facts()
    has_vnni = kernel.status()[0] and kernel.isa() == "avx512"
    methods = (["kernel-avx512"] if has_vnni else []) + ["kernel-avx2", "onednn-int8", "torch-bf16", "torch-fp32"]
    print(f"host {facts.kind} ({', '.join(facts.notable_flags)}), {torch.get_num_threads()} threads, "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s; {up_before}", flush=True)
    torch.manual_seed(0)
    rows = []
    tokens: list[int] = args.tokens
    for shape in args.shapes.split(","):
        k, n = SHAPES[shape]
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        for m in tokens:
            if shape == "lm_head" and m > 1 and not args.lm_head_prefill:
                continue
            x = torch.randn(m, k).to(torch.bfloat16)
            calls: dict[str, Callable[[], Any]] = {}
            nbytes: dict[str, int] = {}
            for name in methods:
                int8_bytes = n * k
                copies = max(1, min(16, LLC_BYTES // int8_bytes + 1)) if m == 1 else 1
                if name in ("torch-fp32", "torch-bf16") and m == 1 and shape == "lm_head":
                    copies = 1  # 1.2-2.3 GB each: larger than any cache already
                make, nbytes[name] = build(name, w, copies)
                calls[name] = make(x)
            errors = {}
            with torch.inference_mode():
                for name, call in calls.items():
                    errors[name] = error_vs_float64(call().float(), x, w)
                per_round: dict[str, list[float]] = {name: [] for name in calls}
                reps = max(3, args.reps if m == 1 else args.reps // 2)
                for _ in range(args.rounds):  # interleaved
                    for name, call in calls.items():
                        call()
                        per_round[name].append(median_ms(call, reps))
            floor_ms = nbytes["kernel-avx2"] / bandwidth * 1e3
            for name, times in per_round.items():
                med = statistics.median(times)
                spread = max(times) / min(times)
                row = {"layer": shape, "K": k, "N": n, "tokens": m, "method": name, "ms": round(med, 4),
                       "rounds_ms": [round(t, 4) for t in times], "spread": round(spread, 3),
                       "spread_flag": spread > SPREAD_FLAG, "bytes_per_call": nbytes[name],
                       "x_int8_read_floor": round(med / floor_ms, 3), "gbps": round(nbytes[name] / med / 1e6, 2),
                       "gop_s": round(2 * m * n * k / med / 1e6, 1), "err_vs_float64": errors[name]}
                if name == "onednn-int8" and not facts.has("avx512_vnni") and not facts.has("avx_vnni"):
                    row["note"] = "no VNNI here: oneDNN's int8 GEMM saturates (wrong numerics, see err_vs_float64)"
                rows.append(row)
                print(f"{shape:20s} {k:5d}->{n:6d} tokens {m:4d} {name:14s} {med:9.3f} ms  "
                      f"x{row['x_int8_read_floor']:6.2f} floor  {row['gbps']:7.2f} GB/s  {row['gop_s']:8.1f} GOP/s  "
                      f"spread {spread:4.2f}"
                      f"{' FLAGGED' if row['spread_flag'] else ''}  err {errors[name]:.2e}", flush=True)
            del calls
    out = {"bench": "dense_kernel", "host_kind": facts.kind, "cpu_flags": facts.notable_flags,
           "cpu_model": facts.model_name, "simulated_flags": facts.simulated, "threads": torch.get_num_threads(),
           "read_bandwidth_gbps": round(bandwidth / 1e9, 2), "uptime_before": up_before, "uptime_after": _uptime(),
           "load_average_before": load_before, "load_average_after": os.getloadavg(), "rounds": args.rounds,
           "spread_flag_above": SPREAD_FLAG,
           "note": "int8 read floor = the kernel's packed bytes / read bandwidth; shared machine: see the load",
           "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
