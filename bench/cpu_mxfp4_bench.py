"""``cpu_mxfp4_*``: the compiled CPU MXFP4 MoE kernel (``quantreg-cpu-mxfp4``) against the MXFP4 read floor.

What runs: :func:`quantreg_cpu_mxfp4.kernel.moe_forward` on a GPT-OSS layer of random valid MXFP4
experts (H = I = 2880, top-4, SwiGLU-OAI with biases), 20B (E=32) and 120B (E=128) expert counts,
at 1, 16 and 256 tokens, on every ISA path this CPU has (AVX-512 and the forced AVX2 baseline),
with the default ``q8x2`` activations, and the best path with plain ``q8`` (``"<isa>/q8"``) beside it.

The floor: one read pass (:func:`bench.read_floor.read_pass`, built by the bench: threaded 256-bit
loads, XOR-reduced) over exactly the
packed bytes (nibbles + scales, w13 + w2) of the experts the same call routes to -- what any
kernel that reads each routed weight once must at least spend. Kernel and floor calls are
interleaved (A B A B ...), medians are reported, and the routed experts rotate from call to call
over the whole layer (1 token: 4 experts per path and call, disjoint from the previous path's, so
no path finds the one before it in the cache; they come back only after 6-8 paths' worth of the
423 MB / 1.7 GB layer, >= 4x this machine's last-level cache), so every call reads DRAM.

:func:`measure` is the building block, for other benchmarks (vLLM-layer comparisons) to call.

Against the issue's comparison goals (20B layer, 1 / 16 / 256 tokens, the same calls interleaved):

* ``mxfp4_reference``: plugin #1's CPU method as it computes (``quantreg_hpu_mxfp4.reference``:
  per routed expert, the bf16 decode from its cache -- default 8 GiB, so the layer stays decoded,
  as in serving -- and torch bf16 matmuls);
* ``vllm_bf16``: vLLM's bf16 CPU MoE kernel (``torch.ops._C.cpu_fused_moe`` through
  ``vllm._custom_ops``, what ``CPUUnquantizedExperts.apply`` calls; ISA ``amx`` where the host has
  AMX, else ``vec``, as vLLM picks) on the same weights exactly dequantised and prepacked the way
  ``process_weights_after_loading`` does; 1.6 GB of bf16 rotate the same way;
* vLLM's ``CPUExpertsMxfp4``: AMX hosts only; this bench does not drive its raw ops (reported as
  such: ``bench/tune_bench.py`` measures it through real vLLM layers at the same shape), and on
  hosts without AMX it is "not measurable here" (vLLM refuses MXFP4 there).

The 1-token comparison is repeated (``rounds``) because the machine is shared: each round is a
full interleaved measurement, and the ratios of every round are reported.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import Metric, child_main, load_average, machine, restored_environ

HIDDEN = INTER = 2880
TOP_K = 4


def packed_inputs(layer: dict[str, torch.Tensor], tokens: int) -> tuple[int, Any, Any, torch.Tensor, torch.Tensor]:
    """What every timed kernel call takes: the layer's expert count, its w13 and w2 packed for the
    kernel, and ``tokens`` bf16 hidden states with top-k routing weights (seeded by ``tokens``)."""
    from quantreg_cpu_mxfp4 import kernel

    w13 = kernel.PackedExperts.from_vllm(layer["w13"], layer["w13_scale"])
    w2 = kernel.PackedExperts.from_vllm(layer["w2"], layer["w2_scale"])
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g), dim=-1)
    return int(layer["w13"].shape[0]), w13, w2, x, weights


def kernel_isas() -> tuple[Any, list[str]]:
    """The plugin's kernel module and the ISA paths this CPU runs, fastest first; raises if it is not built."""
    from quantreg_cpu_mxfp4 import kernel

    ok, why = kernel.status()
    if not ok:
        raise RuntimeError(f"quantreg-cpu-mxfp4's kernel is not available: {why}")
    return kernel, ["avx512", "avx2"] if kernel._supports("avx512") else ["avx2"]


def host_isa() -> str:
    """The host class the issue asks results to carry: "AMX", "AVX-512", "AVX2-only" or "no AVX2"."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    if "amx_tile" in flags:
        return "AMX"
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2-only" if "avx2" in flags else "no AVX2"


def last_level_cache_bytes() -> int:
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        best = max(best, int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return best or 32 << 20


def random_layer(num_experts: int, seed: int) -> dict[str, torch.Tensor]:
    """Valid random MXFP4 experts (every byte is two E2M1 codes; trained-like scale bytes 118..122)."""
    g = torch.Generator().manual_seed(seed)
    u8 = torch.uint8
    return {
        "w13": torch.randint(0, 256, (num_experts, 2 * INTER, HIDDEN // 2), dtype=u8, generator=g),
        "w13_scale": torch.randint(118, 123, (num_experts, 2 * INTER, HIDDEN // 32), dtype=u8, generator=g),
        "w2": torch.randint(0, 256, (num_experts, HIDDEN, INTER // 2), dtype=u8, generator=g),
        "w2_scale": torch.randint(118, 123, (num_experts, HIDDEN, INTER // 32), dtype=u8, generator=g),
        "w13_bias": (torch.randn(num_experts, 2 * INTER, generator=g) * 0.1).to(torch.bfloat16),
        "w2_bias": (torch.randn(num_experts, HIDDEN, generator=g) * 0.1).to(torch.bfloat16),
    }


def routed_ids(tokens: int, num_experts: int, call: int) -> torch.Tensor:
    """1 token: experts 4c..4c+3 (mod E) for call c, so consecutive calls read disjoint weights;
    more tokens: independent random top-4 per token (seeded by the call)."""
    if tokens == 1:
        return torch.tensor([[(TOP_K * call + j) % num_experts for j in range(TOP_K)]], dtype=torch.int32)
    g = torch.Generator().manual_seed(1000 + call)
    return torch.stack([torch.randperm(num_experts, generator=g)[:TOP_K] for _ in range(tokens)]).to(torch.int32)


class Bf16Baselines:
    """The bf16 comparisons on one layer: ``mxfp4_reference`` and vLLM's bf16 CPU MoE kernel."""

    def __init__(self, layer: dict[str, torch.Tensor]) -> None:
        from quantreg.formats.mxfp4 import dequantize_mxfp4
        from quantreg.vllm.cpu_ops import cpu_op

        cpu_prepack_moe_weight = cpu_op("cpu_prepack_moe_weight")  # vllm._custom_ops (0.32) or vllm._cpu_ops (0.34)

        self.layer = layer
        self.isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
        e = layer["w13"].shape[0]
        # vLLM's bf16 kernel: exact bf16 weights, prepacked (process_weights_after_loading does the same).
        w13 = dequantize_mxfp4(layer["w13"], layer["w13_scale"])
        self.w13 = cpu_prepack_moe_weight(w13, self.isa)
        del w13
        w2 = dequantize_mxfp4(layer["w2"], layer["w2_scale"])
        self.w2 = cpu_prepack_moe_weight(w2, self.isa)
        del w2
        self.lists = {name: [layer[name][i] for i in range(e)] for name in
                      ("w13", "w13_scale", "w2", "w2_scale", "w13_bias", "w2_bias")}
        # Warm mxfp4_reference's decode cache over every expert (as after a served model's first
        # batches): otherwise its first calls decode 1.6 GB inside the measurement, slowing the
        # calls interleaved with them (measured: the 1-token floor 7.9 ms instead of 2.0).
        ids = torch.arange(e, dtype=torch.int32).reshape(-1, 1)
        self.mxfp4_reference(torch.zeros(e, layer["w13"].shape[2] * 2, dtype=torch.bfloat16), ids,
                             torch.ones(e, 1))

    def vllm_bf16(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from quantreg.vllm.cpu_ops import cpu_fused_moe

        out = torch.empty_like(x)
        cpu_fused_moe(out, x, self.w13, self.w2, self.layer["w13_bias"], self.layer["w2_bias"], weights,
                      ids, activation="swigluoai", isa=self.isa)
        return out

    def mxfp4_reference(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from quantreg_hpu_mxfp4.reference import bias_mxfp4_fused_weights

        lists = self.lists
        return bias_mxfp4_fused_weights(
            x, ids, weights, lists["w13"], lists["w2"], lists["w13_bias"], lists["w2_bias"], lists["w13_scale"],
            lists["w2_scale"], block_size=32, permuted_weights=True, experts_min=0,
            experts_max=len(lists["w13"]) - 1)


def in_dram(layer: dict[str, torch.Tensor], llc: int) -> bool:
    """Do rotated experts of ``layer`` come from DRAM without help (the layer >= 4x the LLC)?"""
    return sum(t.numel() for t in layer.values()) >= 4 * llc


def measure(layer: dict[str, torch.Tensor], tokens: int, reps: int, paths: list[str],
            baselines: Bf16Baselines | None = None, flush: torch.Tensor | None = None) -> dict[str, Any]:
    """Median ms of ``moe_forward`` per path, of the bf16 baselines and of the read floor, interleaved.

    ``paths``: ``"avx512"`` / ``"avx2"`` (default q8x2 activations), ``"<isa>/q8"``, and, with
    ``baselines``, ``"mxfp4_reference"`` / ``"vllm_bf16"``. Same routing for every path per rep,
    except at 1 token (each path its own experts: see the module docstring). ``flush``: a buffer
    read (untimed) before every timed call, on hosts whose last-level cache could hold the layer.
    """
    from quantreg_cpu_mxfp4 import kernel

    from bench.read_floor import read_pass

    e, w13, w2, x, weights = packed_inputs(layer, tokens)
    times: dict[str, list[float]] = {p: [] for p in [*paths, "floor"]}
    floor_bytes: list[int] = []
    with restored_environ(kernel.ISA_ENV, kernel.PRECISION_ENV):
        every = [*paths, "floor"]
        for call in range(reps + 1):  # call 0 warms up (page tables, thread pool) and is dropped
            for index, path in enumerate(every):
                # 1 token: every path of a call gets its own 4 experts (53 MB, more than the LLC
                # holds), so no path finds the previous path's weights in the cache; more tokens
                # touch most of the layer, so every path of a call shares one routing.
                ids = routed_ids(tokens, e, call * len(every) + index if tokens == 1 else call)
                used = torch.unique(ids).tolist()
                pieces = [layer[name][i] for i in used for name in ("w13", "w13_scale", "w2", "w2_scale")]
                if flush is not None:  # evict the LLC: the weights must come from DRAM, as in serving
                    read_pass([flush])
                start = time.perf_counter()
                if path == "floor":
                    read_pass(pieces)
                elif path in ("mxfp4_reference", "vllm_bf16"):
                    assert baselines is not None, f"{path} needs the bf16 baselines"
                    getattr(baselines, path)(x, ids, weights)
                else:  # "avx512", "avx2" (default q8x2 activations) or "avx512/q8" (plain Q8)
                    isa, _, precision = path.partition("/")
                    os.environ[kernel.ISA_ENV] = isa
                    os.environ[kernel.PRECISION_ENV] = precision or "q8x2"
                    kernel.moe_forward(x, ids, weights, w13, layer["w13_bias"], w2, layer["w2_bias"])
                if call:
                    times[path].append(time.perf_counter() - start)
            if call:
                floor_bytes.append(sum(p.numel() for p in pieces))  # the floor's (last) pieces
    out: dict[str, Any] = {f"{p}_ms": statistics.median(v) * 1e3 for p, v in times.items()}
    for p in paths:
        out[f"{p}_over_floor"] = out[f"{p}_ms"] / out["floor_ms"]
    out.update(tokens=tokens, experts=e, samples=reps, routed_mb=statistics.median(floor_bytes) / 1e6,
               floor_gb_s=statistics.median(floor_bytes) / (out["floor_ms"] * 1e-3) / 1e9)
    return out


def run(quick: bool) -> list[Metric]:
    _, isas = kernel_isas()
    best = isas[0]  # the path moe_forward picks by default, with its default q8x2 activations
    paths = [*isas, f"{best}/q8"]
    compared = [*paths, "mxfp4_reference", "vllm_bf16"]
    llc = last_level_cache_bytes()
    facts = machine()
    host = {"host_isa": host_isa(), "host_kind": facts["host_kind"], "logical_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "vllm": facts["vllm"],
            "last_level_cache_mb": llc / 2**20, "load_average_at_start": load_average()}
    results: dict[str, dict[str, Any]] = {}
    one_token_rounds: list[dict[str, Any]] = []
    # no_grad, not inference_mode: mxfp4_reference's decode cache keys on the weights' version
    # counters, which inference tensors lack (in vLLM the weights are ordinary parameters too).
    with torch.no_grad():
        layer = random_layer(32, seed=20)
        # Rotating the routed experts keeps the calls in DRAM only if the layer is >= 4x the LLC; a
        # host with a larger LLC (an Intel Xeon VM here reports 480 MiB L3) gets an untimed read of
        # twice the LLC before every timed call instead.
        flush = None if in_dram(layer, llc) else torch.ones(2 * llc, dtype=torch.uint8)
        host["llc_flush_mb"] = 0 if flush is None else 2 * llc / 2**20
        host["layer_20b_mb"] = sum(t.numel() for t in layer.values()) / 2**20
        baselines = Bf16Baselines(layer)
        for tokens, reps in ((1, 15 if quick else 41), (16, 7 if quick else 21), (256, 3 if quick else 7)):
            results[f"20b_{tokens}"] = measure(layer, tokens, reps, compared, baselines, flush)
            results[f"20b_{tokens}"]["load_average"] = load_average()
        for _ in range(1 if quick else 2):  # the 1-token ratios again: the machine is shared
            r = measure(layer, 1, 15 if quick else 41, compared, baselines, flush)
            one_token_rounds.append({"load_average": load_average(), **{
                k: r[k] for k in (f"{best}_ms", "vllm_bf16_ms", "mxfp4_reference_ms", "floor_ms")}})
        del baselines, layer
        layer = random_layer(128, seed=120)
        # the 120B layer is 4x the 20B one: if that needed no eviction, neither does this
        results["120b_1"] = measure(layer, 1, 15 if quick else 41, paths, flush=None if in_dram(layer, llc) else flush)
        del layer

    def line(key: str) -> str:
        r = results[key]
        per_path = ", ".join(f"{p} {r[f'{p}_ms']:.2f} ms (x{r[f'{p}_over_floor']:.2f})" for p in paths)
        return (f"{key.replace('_', ' layer, ')} token(s): {per_path}; floor {r['floor_ms']:.2f} ms "
                f"({r['routed_mb']:.0f} MB routed, {r['floor_gb_s']:.1f} GB/s)")

    one, big = results["20b_1"], results["120b_1"]
    r16, r256 = results["20b_16"], results["20b_256"]
    one_token_rounds.insert(0, {"load_average": one["load_average"], **{
        k: one[k] for k in (f"{best}_ms", "vllm_bf16_ms", "mxfp4_reference_ms", "floor_ms")}})
    goals = {1: 2.5, 16: 1.5, 256: 1.0}  # issue 19: speed-up over vLLM's bf16 kernel
    vs_bf16: dict[str, Any] = {}
    for tokens, goal in goals.items():
        r = results[f"20b_{tokens}"]
        vs_bf16[str(tokens)] = {
            "cpu_mxfp4_ms": r[f"{best}_ms"], "cpu_mxfp4_q8_ms": r[f"{best}/q8_ms"],
            "mxfp4_reference_ms": r["mxfp4_reference_ms"], "vllm_bf16_ms": r["vllm_bf16_ms"],
            "floor_ms": r["floor_ms"], "speedup": r["vllm_bf16_ms"] / r[f"{best}_ms"],
            "speedup_q8": r["vllm_bf16_ms"] / r[f"{best}/q8_ms"],
            "vs_reference": r["mxfp4_reference_ms"] / r[f"{best}_ms"], "goal": goal,
            "goal_met": r["vllm_bf16_ms"] / r[f"{best}_ms"] >= goal, "load_average": r["load_average"]}
    one_token_speedups = [r["vllm_bf16_ms"] / r[f"{best}_ms"] for r in one_token_rounds]
    vllm_mxfp4 = ("not measurable here: no AMX (vLLM refuses GPT-OSS MXFP4 on this host)"
                  if facts["host_kind"] != "amx" else "AMX host: measured through real vLLM layers by the tune "
                  "group (tune_20b_vllm), not by this bench")

    def side_by_side(tokens: int) -> str:
        v = vs_bf16[str(tokens)]
        return (f"20B layer, {tokens} token(s): cpu_mxfp4 {v['cpu_mxfp4_ms']:.1f} ms (q8 {v['cpu_mxfp4_q8_ms']:.1f}), "
                f"mxfp4_reference {v['mxfp4_reference_ms']:.1f}, vLLM bf16 ({baselines_isa}) "
                f"{v['vllm_bf16_ms']:.1f}, floor {v['floor_ms']:.1f} ms: x{v['speedup']:.2f} faster than vLLM bf16 "
                f"(q8 x{v['speedup_q8']:.2f}; goal >= x{v['goal']}: {'met' if v['goal_met'] else 'NOT met'}), "
                f"x{v['vs_reference']:.2f} vs mxfp4_reference; load {v['load_average']}")

    baselines_isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
    notes = [line(k) for k in results] + [side_by_side(t) for t in goals] + [
        "1-token speed-up over vLLM bf16, every round: " + ", ".join(f"x{s:.2f}" for s in one_token_speedups),
        f"vLLM's CPUExpertsMxfp4: {vllm_mxfp4}"] + [
        f"host {host['host_isa']}, {host['logical_cpus']} CPUs, {host['torch_threads']} torch threads, "
        f"torch {host['torch']}, vLLM {host['vllm']}; load average at the end {load_average()} (a shared "
        "machine: absolute times are noisy, the interleaved ratios less so)"]
    common = {"host": host, "results": results}
    speedups = [vs_bf16[str(t)]["speedup"] for t in goals]
    return [
        Metric("cpu_mxfp4_vs_vllm_bf16", one[f"{best}_ms"], "ms", baseline=one["vllm_bf16_ms"],
               baseline_name=f"vLLM's bf16 CPU MoE kernel ({baselines_isa}) on the exactly dequantised weights",
               ratio=speedups[0], ratio_means="vLLM bf16 / cpu_mxfp4 (higher is better), 1 token",
               goal=">= 2.5x at 1 token, >= 1.5x at 16, >= 1.0x at 256",
               goal_met=all(vs_bf16[str(t)]["goal_met"] for t in goals),
               extra={"host": host, "vs_bf16": vs_bf16, "one_token_rounds": one_token_rounds,
                      "one_token_speedups": one_token_speedups, "vllm_cpu_experts_mxfp4": vllm_mxfp4,
                      "display_ratio": " / ".join(f"x{s:.2f}" for s in speedups),
                      "display_value": " / ".join(f"{vs_bf16[str(t)]['cpu_mxfp4_ms']:.1f}" for t in goals),
                      "display_baseline": " / ".join(f"{vs_bf16[str(t)]['vllm_bf16_ms']:.1f}" for t in goals)}),
        Metric("cpu_mxfp4_floor_ratio", one[f"{best}_ms"], "ms", baseline=one["floor_ms"],
               baseline_name="MXFP4 read floor: one read pass over the routed experts' packed bytes",
               ratio=one[f"{best}_over_floor"], ratio_means="kernel / floor (lower is better)",
               goal="<= 1.25x the floor at 1 token, GPT-OSS-20B layer", goal_met=one[f"{best}_over_floor"] <= 1.25,
               notes=notes, extra={**common, "isa_path": best}),
        Metric("cpu_mxfp4_floor_ratio_120b", big[f"{best}_ms"], "ms", baseline=big["floor_ms"],
               baseline_name="MXFP4 read floor (120B layer, E=128)", ratio=big[f"{best}_over_floor"],
               ratio_means="kernel / floor (lower is better)", goal="<= 1.25x the floor at 1 token, GPT-OSS-120B layer",
               goal_met=big[f"{best}_over_floor"] <= 1.25, extra={"isa_path": best}),
        Metric("cpu_mxfp4_tokens_16_256", results["20b_16"][f"{best}_ms"], "ms",
               baseline=results["20b_16"]["floor_ms"], baseline_name="MXFP4 read floor, 16 tokens",
               ratio=results["20b_16"][f"{best}_over_floor"], ratio_means="kernel / floor at 16 tokens",
               goal="report (256 tokens in display)",
               extra={"display_value": f"{r16[f'{best}_ms']:.1f} / {r256[f'{best}_ms']:.1f}",
                      "display_baseline": f"floor {r16['floor_ms']:.1f} / {r256['floor_ms']:.1f}",
                      "display_ratio": f"x{r16[f'{best}_over_floor']:.2f} / x{r256[f'{best}_over_floor']:.2f}"}),
    ]


def main() -> None:
    child_main(run, __doc__)


if __name__ == "__main__":
    main()
