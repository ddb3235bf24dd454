"""``cpu_mxfp4_speed``: plugin #2 at decode against the MXFP4 read floor, at prefill against fp32 SGEMM (issue 44.2).

What runs, on a GPT-OSS-20B layer of random valid MXFP4 experts (E=32, H = I = 2880, top-4,
SwiGLU-OAI with biases; :mod:`bench.cpu_mxfp4_bench`'s layer and routing), every ISA path this CPU
has (``avx512`` and the forced ``avx2`` baseline, ``QUANTREG_CPU_MXFP4_ISA``):

* decode, 1 token: :func:`bench.cpu_mxfp4_bench.measure` (kernel and the read floor interleaved,
  routed experts rotated so every call reads DRAM), ``rounds`` times; every round's ratio is kept
  and the spread printed, because the 2 cores are shared;
* prefill, 512 tokens: the kernel's forward (default thresholds: which experts take the GEMM path
  is the kernel's choice) against ``torch.mm`` in fp32 on the same FLOPs -- for every routed expert
  with ``c`` tokens, ``[c, H] @ [H, 2I]`` and ``[c, I] @ [I, H]`` -- interleaved round by round.
  FLOPs counted as ``2 * tokens * top_k * (H * 2I + I * H)`` for both.

Forcing ``avx2`` changes the plugin's code path only: torch's own GEMMs (the prefill callback and
the SGEMM reference) still run at this CPU's ISA. The host kind and the load average of every
round are in the JSON.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

from bench.common import Metric, child_main, load_average, machine, restored_environ
from bench.cpu_mxfp4_bench import (
    HIDDEN,
    INTER,
    TOP_K,
    host_isa,
    kernel_isas,
    measure,
    packed_inputs,
    random_layer,
    routed_ids,
)

PREFILL_TOKENS = 512


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _sgemm(ids: torch.Tensor, experts: int) -> Any:
    """fp32 ``torch.mm`` on every routed expert's token count, the kernel's FLOPs exactly."""
    counts = torch.bincount(ids.flatten().long(), minlength=experts).tolist()
    w13 = torch.randn(HIDDEN, 2 * INTER)
    w2 = torch.randn(INTER, HIDDEN)
    inputs = [torch.randn(c, HIDDEN) for c in counts if c]

    def run() -> None:
        for x in inputs:
            h = torch.mm(x, w13)
            torch.mm(h[:, :INTER].contiguous(), w2)

    return run


def prefill(layer: dict[str, torch.Tensor], paths: list[str], rounds: int) -> dict[str, Any]:
    from quantreg_cpu_mxfp4 import kernel

    e, w13, w2, x, weights = packed_inputs(layer, PREFILL_TOKENS)
    flops = 2 * PREFILL_TOKENS * TOP_K * (HIDDEN * 2 * INTER + INTER * HIDDEN)
    times: dict[str, list[float]] = {p: [] for p in [*paths, "sgemm_fp32"]}
    loads: list[float] = []
    with restored_environ(kernel.ISA_ENV):
        for call in range(rounds + 1):  # call 0 warms up (page tables, oneDNN primitives) and is dropped
            ids = routed_ids(PREFILL_TOKENS, e, call)
            sgemm = _sgemm(ids, e)
            for path in [*paths, "sgemm_fp32"]:
                start = time.perf_counter()
                if path == "sgemm_fp32":
                    sgemm()
                else:
                    os.environ[kernel.ISA_ENV] = path
                    kernel.moe_forward(x, ids, weights, w13, layer["w13_bias"], w2, layer["w2_bias"])
                if call:
                    times[path].append(time.perf_counter() - start)
            if call:
                loads.append(load_average()[0] if load_average() else float("nan"))
    out: dict[str, Any] = {"tokens": PREFILL_TOKENS, "gflop": flops / 1e9, "rounds": rounds, "load_per_round": loads}
    for path, values in times.items():
        out[f"{path}_ms"] = {k: v * 1e3 for k, v in _spread(values).items()}
        out[f"{path}_gflops"] = [flops / v / 1e9 for v in values]
    for path in paths:  # per round: the kernel against the SGEMM of the same round
        out[f"{path}_over_sgemm"] = [s / k for k, s in zip(times[path], times["sgemm_fp32"], strict=True)]
    return out


def run(quick: bool) -> list[Metric]:
    kernel, paths = kernel_isas()
    facts = machine()
    rounds = 3 if quick else 5
    host = {"host_isa": host_isa(), "host_kind": facts["host_kind"], "logical_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "vllm": facts["vllm"],
            "avx512_bf16": kernel._supports("avx512_bf16"), "load_average_at_start": load_average(),
            "forced_avx2_note": "QUANTREG_CPU_MXFP4_ISA=avx2 forces the plugin's path only; torch's GEMMs "
                                "(prefill callback, SGEMM reference) run at this CPU's ISA"}
    with torch.no_grad():
        layer = random_layer(32, seed=20)
        decode_rounds = []
        for _ in range(rounds):
            r = measure(layer, 1, 11 if quick else 21, paths)
            decode_rounds.append({"load_average": load_average(), **{
                k: v for k, v in r.items() if k.endswith(("_ms", "_over_floor")) or k in ("routed_mb", "floor_gb_s")}})
        pre = prefill(layer, paths, rounds)
    decode = {p: _spread([r[f"{p}_over_floor"] for r in decode_rounds]) for p in paths}
    host["load_average_at_end"] = load_average()
    notes = [f"decode 1 token, {p}: x{d['median']:.2f} the read floor (rounds x{d['min']:.2f}-x{d['max']:.2f}; "
             f"goal <= x1.25)" for p, d in decode.items()]
    notes += [f"prefill {PREFILL_TOKENS} tokens, {p}: {statistics.median(pre[f'{p}_gflops']):.0f} GFLOP/s "
              f"({pre[f'{p}_ms']['median']:.0f} ms, rounds {min(pre[f'{p}_gflops']):.0f}-"
              f"{max(pre[f'{p}_gflops']):.0f}); "
              f"fp32 SGEMM of the same FLOPs {statistics.median(pre['sgemm_fp32_gflops']):.0f} GFLOP/s; kernel / SGEMM "
              f"speed x{statistics.median(pre[f'{p}_over_sgemm']):.2f}" for p in paths]
    notes.append(f"host {host['host_isa']} ({host['host_kind']}), {host['logical_cpus']} CPUs, load "
                 f"{host['load_average_at_start']} -> {host['load_average_at_end']} (a shared machine)")
    best = paths[0]
    extra = {"host": host, "decode_rounds": decode_rounds, "decode_over_floor": decode, "prefill": pre}
    return [
        Metric("cpu_mxfp4_decode_floor_ratio", decode_rounds[0][f"{best}_ms"], "ms",
               baseline=decode_rounds[0]["floor_ms"], baseline_name="MXFP4 read floor (4 routed experts, 52.9 MB)",
               ratio=decode[best]["median"], ratio_means="kernel / floor, median of rounds (lower is better)",
               goal="<= 1.25x the floor at 1 token", goal_met=all(d["median"] <= 1.25 for d in decode.values()),
               notes=notes, extra=extra),
        Metric("cpu_mxfp4_prefill_gflops", statistics.median(pre[f"{best}_gflops"]), "GFLOP/s",
               baseline=statistics.median(pre["sgemm_fp32_gflops"]), baseline_name="torch.mm fp32, same FLOPs",
               ratio=statistics.median(pre[f"{best}_over_sgemm"]), ratio_means="kernel speed / SGEMM speed",
               goal=">= fp32 SGEMM at 512 tokens",
               goal_met=all(statistics.median(pre[f"{p}_over_sgemm"]) >= 1.0 for p in paths)),
    ]


def main() -> None:
    child_main(run, __doc__)


if __name__ == "__main__":
    main()
