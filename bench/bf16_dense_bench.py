"""The plugin's bf16 dense kernel (``cpu_bf16_dense_kernel``) alone, at GPT-OSS-20B's dense shapes (issue 55).

Per shape (qkv 2880->5120, o_proj 4096->2880, router 2880->32, lm_head 2880->201088) and token
count (1 and 512; the lm_head at 1 token only unless ``--lm-head-prefill``: vLLM computes logits for
the sampled positions only, and 512 tokens of it in torch's bf16 path take minutes), in interleaved
rounds in one process:

* ``kernel-avx512`` / ``kernel-avx2``: :func:`quantreg_cpu_bf16_dense.kernel.linear` on each ISA path
  (AVX2 forced with ``QUANTREG_CPU_BF16_DENSE_ISA``; AVX-512 BF16 only where the CPU has it);
* ``torch-bf16``: ``torch.nn.functional.linear`` on the bf16 weight (what vLLM-CPU falls back to
  without AVX-512 BF16: "Failed to create oneDNN linear, fallback to torch linear");
* ``torch-fp32``: the same on an fp32 copy of the weight (torch's fp32 SGEMM: the prefill bar).

The read floor: the bf16 weight's bytes (``N x K x 2``) over the read bandwidth measured in the same
round (``bench/read_floor.py``: a threaded read pass over 1 GiB, the fastest of 3), so each 1-token
row carries ``x_bf16_floor`` (1.0 = reading the weight at the bus). At 1 token each method cycles
through enough copies of its weight that together they exceed the last-level cache, so every call
reads from memory.

Rounds: ``--rounds`` (>= 3) interleaved rounds, each the median of ``--reps`` calls per method; the
JSON holds every round, the median and the spread (max/min), and flags rows whose rounds disagree by
more than :data:`SPREAD_FLAG`. The machine may be shared with other work (it was, with other agents,
when the committed results were taken): ``uptime``'s load averages before and after are in the JSON,
and ``shared_host`` says so -- the speeds are indicative; a quiet re-run is the one to quote.

    python bench/bf16_dense_bench.py [--rounds 3] [--json bench/results/bf16_dense.json]
"""

from __future__ import annotations

import argparse
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

SHAPES = {"qkv_proj": (2880, 5120), "o_proj": (4096, 2880), "router": (2880, 32), "lm_head": (2880, 201088)}
SPREAD_FLAG = 1.5
LLC_BYTES = 256 << 20
"""Bytes of weight copies cycled through at 1 token (well past any last-level cache here)."""
ISA_ENV = "QUANTREG_CPU_BF16_DENSE_ISA"


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return ""


def read_bandwidth(passes: int = 3) -> float:
    """Bytes per second of a threaded read pass over 1 GiB, the fastest of ``passes``."""
    import torch

    from bench.read_floor import read_pass

    buf = torch.ones(1 << 28, dtype=torch.int32)  # 1 GiB, touched
    best = 0.0
    for _ in range(passes):
        t = time.perf_counter()
        read_pass([buf])
        best = max(best, buf.numel() * 4 / (time.perf_counter() - t))
    return best


def median_ms(fn: Callable[[], Any], n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def error_vs_float64(out: Any, x: Any, w: Any) -> float:
    """``max|out - ref| / max|ref|`` against ``x @ w.T`` in float64 (on at most 4,096 rows)."""
    rows = min(4096, w.shape[0])
    ref = x.double() @ w[:rows].double().t()
    return float((out[..., :rows].double() - ref).abs().max() / ref.abs().max())


def _calls(m: int, k: int, n: int, isas: list[str]) -> tuple[dict[str, Callable[[], Any]], dict[str, float]]:
    """The methods' calls for one (shape, tokens) and their error against float64 (one call each)."""
    import torch
    from quantreg_cpu_bf16_dense import kernel

    gen = torch.Generator().manual_seed(k + n)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    x32 = x.float()
    # enough copies to leave the LLC at 1 token (the bf16 bytes; fp32 copies are twice as large)
    copies = 1 if m > 1 else max(1, -(-LLC_BYTES // (n * k * 2)))
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    packed = [kernel.PackedWeight.from_weight(v) for v in ws]
    w32s = [v.float() for v in ws]
    state = {"i": 0}

    def nxt() -> int:
        state["i"] += 1
        return state["i"] % copies

    def kernel_call(isa: str) -> Callable[[], Any]:
        def call() -> Any:
            os.environ[ISA_ENV] = isa
            return kernel.linear(x, packed[nxt()])
        return call

    calls: dict[str, Callable[[], Any]] = {f"kernel-{isa}": kernel_call(isa) for isa in isas}
    calls["torch-bf16"] = lambda: torch.nn.functional.linear(x, ws[nxt()])
    calls["torch-fp32"] = lambda: torch.nn.functional.linear(x32, w32s[nxt()])
    errors = {name: error_vs_float64(call().float(), x, w) for name, call in calls.items()}
    return calls, errors


def main() -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=whole(3, 1000), default=3, help="rounds (>= 3: the spread needs rounds)")
    parser.add_argument("--reps", type=whole(1, 100_000), default=15, help="calls per method per round at 1 token")
    parser.add_argument("--reps-prefill", type=whole(1, 100_000), default=3,
                        help="calls per method per round at 512 tokens")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {', '.join(SHAPES)}")
    parser.add_argument("--threads", type=whole(0, 4096), default=0,
                        help="torch (and kernel) threads; 0: torch's default")
    parser.add_argument("--tokens", type=whole_list(1, 65536), default=[1, 512],
                        help="comma-separated token counts (default 1,512)")
    parser.add_argument("--lm-head-prefill", action="store_true", help="the lm_head at 512 tokens too (slow)")
    parser.add_argument("--json", default="bench/results/bf16_dense.json")
    parser.add_argument("--shared-host", default="yes", choices=("yes", "no"),
                        help="whether other work shared the machine (recorded; speeds then indicative)")
    args = parser.parse_args()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(unknown)}; expected some of {', '.join(SHAPES)}")

    tokens = tuple(args.tokens)
    import torch
    from quantreg_cpu_bf16_dense import kernel

    from quantreg.host import host_facts

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    ok, why = kernel.status()
    if not ok:
        sys.exit(f"bf16_dense_bench: the kernel cannot run here: {why}")
    facts = host_facts()
    isas = (["avx512"] if kernel.isa() == "avx512" else []) + ["avx2"]
    up_before, load_before = _uptime(), os.getloadavg()
    print(f"host kind {facts.kind} ({', '.join(facts.notable_flags)}), {torch.get_num_threads()} threads, "
          f"kernel paths {', '.join(isas)}; {up_before}", flush=True)
    rows: list[dict[str, Any]] = []
    bandwidths: list[float] = []
    for shape in shapes:
        k, n = SHAPES[shape]
        for m in tokens:
            if m > 1 and shape == "lm_head" and not args.lm_head_prefill:
                continue
            calls, errors = _calls(m, k, n, isas)
            reps = args.reps if m == 1 else args.reps_prefill
            for call in calls.values():  # warm-up (first-call costs, the thread pool)
                call()
            rounds: dict[str, list[float]] = {name: [] for name in calls}
            round_bw: list[float] = []
            for _ in range(args.rounds):
                round_bw.append(read_bandwidth())
                for name, call in calls.items():
                    rounds[name].append(median_ms(call, reps))
            bandwidths += round_bw
            bw = statistics.median(round_bw)
            floor_ms = n * k * 2 / bw * 1e3
            for name, times in rounds.items():
                med = statistics.median(times)
                spread = max(times) / min(times)
                row = {"shape": shape, "k": k, "n": n, "tokens": m, "method": name,
                       "ms_rounds": [round(t, 4) for t in times], "ms": round(med, 4), "spread": round(spread, 3),
                       "spread_flag": spread > SPREAD_FLAG,
                       "read_bw_gbps_rounds": [round(b / 1e9, 2) for b in round_bw],
                       "bf16_floor_ms": round(floor_ms, 4), "x_bf16_floor": round(med / floor_ms, 3),
                       "gflop_s": round(2 * m * n * k / med / 1e6, 1), "err_vs_float64": errors[name]}
                if m == 1:
                    row["weight_gbps"] = round(n * k * (4 if name == "torch-fp32" else 2) / med / 1e6, 2)
                rows.append(row)
                print(f"{shape:9s} {k:5d}->{n:6d} tokens {m:4d} {name:14s} {med:10.3f} ms  "
                      f"x{row['x_bf16_floor']:7.2f} bf16 floor  {row['gflop_s']:8.1f} GFLOP/s  spread {spread:4.2f}"
                      f"{' FLAGGED' if row['spread_flag'] else ''}  err {errors[name]:.2e}", flush=True)
            del calls
    by = {(r["shape"], r["tokens"], r["method"]): r for r in rows}
    ratios = {}
    for (shape, m, name), r in by.items():
        if name.startswith("kernel-"):
            ratios[f"{shape} {m} tok {name}"] = {
                "vs_torch_bf16": round(by[(shape, m, "torch-bf16")]["ms"] / r["ms"], 2),
                "vs_torch_fp32": round(by[(shape, m, "torch-fp32")]["ms"] / r["ms"], 2),
                "x_bf16_floor": r["x_bf16_floor"]}
    out = {"bench": "bf16_dense", "host_kind": facts.kind, "host_is": "real (no simulated flags)"
           if not facts.simulated else "simulated flags", "cpu_flags": facts.notable_flags,
           "cpu_model": facts.model_name, "threads": torch.get_num_threads(), "torch": torch.__version__,
           "kernel_paths": isas, "read_bandwidth_gbps_rounds": [round(b / 1e9, 2) for b in bandwidths],
           "shared_host": args.shared_host == "yes",
           "shared_host_note": "the machine was shared with other agents' work during the run: speeds are "
                               "indicative, compare methods within a round" if args.shared_host == "yes" else "",
           "uptime_before": up_before, "uptime_after": _uptime(), "load_average_before": load_before,
           "load_average_after": os.getloadavg(), "rounds": args.rounds, "tokens": list(tokens),
           "spread_flag_above": SPREAD_FLAG,
           "note": "bf16 floor = N x K x 2 bytes / the read bandwidth measured in the same rounds; "
                   "x_bf16_floor 1.0 = the weight read at the bus",
           "kernel_speedups": ratios, "rows": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
