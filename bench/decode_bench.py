"""``reference_decode_ms``: the ``mxfp4_reference`` MoE forward at the GPT-OSS-20B layer shape, top-4.

What runs: the plugin's :class:`~quantreg_hpu_mxfp4.hpu_op.MoeOp` over :func:`reference_ops` -- the
exact forward of the ``mxfp4_reference`` method after routing -- on packed MXFP4 weights (E=32,
H=I=2880, SwiGLU-OAI with biases), 1 and 16 tokens, fixed expert choices. Its decoded-weight cache
is warmed first (decoding happens once per weight set, at the first forward), so this is the
steady-state decode step.

Side by side, on the same (exactly dequantised) weights and the same expert choices:

* vLLM's own CPU MoE kernel on bf16 weights: ``torch.ops._C.cpu_fused_moe`` with the ``vec`` ISA on
  ``prepack_moe_weight`` output, which is what vLLM's ``UnquantizedFusedMoEMethod`` runs on this CPU.
  vLLM 0.32's CPU MXFP4 kernel (``GptOssMxfp4MoEMethod`` -> ``fused_experts_cpu``) needs AMX, which this
  machine lacks, so that comparison is reported as not available rather than as a number.
* the bf16 bandwidth floor: the bytes of bf16 weights of the distinct experts the tokens touch,
  over this machine's read bandwidth (the fastest of 7 sums over 1 GiB of fp32, measured here).
* vLLM's own CPU MXFP4 kernel (``GptOssMxfp4MoEMethod`` -> ``CPUExpertsMxfp4``), wherever it runs (an
  x86 host with AMX): a real vLLM layer at the same shape built, loaded and processed by quantreg's
  kit harness (``VllmMoeHarness.build_routed``, vLLM's own method choice), the same weights, router
  logits that pick the same experts, forward through ``MoERunner.forward``. On a host without AMX
  vLLM refuses that layer, and the row says so (with the host kind) instead of a number.
"""

from __future__ import annotations

import functools

import torch

from bench.common import Metric, child_main, load_average, median, timed
from quantreg.formats.mxfp4 import dequantize_mxfp4, random_mxfp4

E, HIDDEN, INTER, TOP_K = 32, 2880, 2880, 4
READ_BYTES = 1 << 30


def amx_available() -> bool:
    """Whether vLLM's own CPU MXFP4 kernel runs here (what vLLM itself will find; AMX hidden counts as absent)."""
    from quantreg.testing.host_kind import real_amx

    return real_amx()


def vllm_mxfp4_layer(w13: torch.Tensor, s13: torch.Tensor, b13: torch.Tensor, w2: torch.Tensor,
                     s2: torch.Tensor, b2: torch.Tensor) -> tuple[object, str]:
    """(a ready vLLM layer running vLLM's own MXFP4 method, "") where its kernel runs, else (None, why)."""
    from quantreg.host import host_facts

    if not amx_available():
        return None, (f"not measured on this host (kind {host_facts().kind}, no AMX): vLLM's CPU MXFP4 kernel "
                      "(GptOssMxfp4MoEMethod -> CPUExpertsMxfp4) needs AMX and vLLM refuses the layer")
    from quantreg.models.gpt_oss_moe import GptOssMxfp4Experts
    from quantreg.testing.harness import VllmMoeHarness
    from quantreg.testing.shapes import MoeShape

    harness = VllmMoeHarness()
    try:
        layer = harness.build_routed(shape=MoeShape(E, HIDDEN, INTER), top_k=TOP_K, bias=True)
        layer.load(GptOssMxfp4Experts(w13, s13, w2, s2, b13, b2))
        layer.process()
    except Exception as exc:  # a number or a reason, never a crash of the whole group
        harness.close()
        return None, f"AMX present but vLLM's MXFP4 layer failed: {type(exc).__name__}: {exc}"[:500]
    return (harness, layer), ""


def logits_for(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Router logits whose softmax-top-k picks exactly ``ids`` (the reference's fixed choices)."""
    logits = torch.full((ids.shape[0], E), -30.0)
    logits.scatter_(1, ids.long(), torch.log(weights.float()))
    return logits.to(torch.bfloat16)


def tokens(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(count, HIDDEN, generator=g) * 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(count)]).to(torch.int32)
    weights = torch.softmax(torch.randn(count, TOP_K, generator=g), dim=-1)
    return x, ids, weights


def run(quick: bool) -> list[Metric]:
    from quantreg.vllm.cpu_ops import load

    load()  # registers torch.ops._C (vLLM's CPU kernels): vllm._custom_ops, or vllm._cpu_ops from 0.34
    from quantreg_hpu_mxfp4.hpu_op import ExpertWeights, MoeOp, reference_ops  # type: ignore[import-untyped]

    w13, s13 = random_mxfp4((E, 2 * INTER, HIDDEN), seed=30)
    w2, s2 = random_mxfp4((E, HIDDEN, INTER), seed=31)
    g = torch.Generator().manual_seed(32)
    b13 = (torch.randn(E, 2 * INTER, generator=g) * 0.1).to(torch.bfloat16)
    b2 = (torch.randn(E, HIDDEN, generator=g) * 0.1).to(torch.bfloat16)
    op = MoeOp(reference_ops(), ExpertWeights.from_layer(w13, s13, b13, E), ExpertWeights.from_layer(w2, s2, b2, E),
               0, E - 1, mxfp4=True)

    # vLLM's CPU kernel on the same weights, exactly dequantised and prepacked as vLLM does at load.
    dense13, dense2 = dequantize_mxfp4(w13, s13), dequantize_mxfp4(w2, s2)
    packed13, packed2 = torch.empty_like(dense13), torch.empty_like(dense2)
    torch.ops._C.prepack_moe_weight(dense13, packed13, "vec")
    torch.ops._C.prepack_moe_weight(dense2, packed2, "vec")
    del dense13, dense2

    def reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = op(x, ids, weights.to(torch.bfloat16), activation="swigluoai")
        return out

    def vllm_kernel(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops._C.cpu_fused_moe(out, x, packed13, packed2, b13, b2, weights, ids, False, "swigluoai", "vec")
        return out

    from quantreg_hpu_mxfp4.reference import CACHE  # type: ignore[import-untyped]

    def matmuls_only(x: torch.Tensor, ids: torch.Tensor) -> None:
        """Just the reference's bf16 matmuls (same experts, same token counts, decoded weights
        cached): what is left of a forward once routing, activation and the sum are removed."""
        for e, n in zip(*torch.unique(ids, return_counts=True)):
            rows = x[: int(n)]
            h = rows @ CACHE.get(w13[int(e)], s13[int(e)]).t()
            _ = h[:, :INTER] @ CACHE.get(w2[int(e)], s2[int(e)]).t()

    every = torch.arange(E, dtype=torch.int32).view(-1, TOP_K)
    reference(torch.zeros(every.shape[0], HIDDEN, dtype=torch.bfloat16), every,
              torch.full(every.shape, 1.0 / TOP_K))  # decode every expert once: the method's load-time work

    big = torch.ones(READ_BYTES // 4, dtype=torch.float32)
    read_times = [timed(big.sum) for _ in range(7)]
    read_bw = READ_BYTES / min(read_times)  # a floor is a bound: the fastest read seen, not the typical one
    del big
    per_expert = (2 * INTER * HIDDEN + HIDDEN * INTER) * 2  # bf16 bytes of one expert's w13 + w2

    own, own_reason = vllm_mxfp4_layer(w13, s13, b13, w2, s2, b2)
    results: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for count, reps in ((1, 15 if quick else 41), (16, 5 if quick else 15)):
            x, ids, weights = tokens(count, seed=33 + count)
            a, b = reference(x, ids, weights), vllm_kernel(x, ids, weights)  # warm-up, and the same answer?
            rel = float((a.float() - b.float()).abs().max() / b.float().abs().max())
            ref_t: list[float] = []
            vllm_t: list[float] = []
            mm_t: list[float] = []
            run_reference = functools.partial(reference, x, ids, weights)
            run_vllm = functools.partial(vllm_kernel, x, ids, weights)
            run_matmuls = functools.partial(matmuls_only, x, ids)
            for _ in range(reps):
                ref_t.append(timed(run_reference))
                vllm_t.append(timed(run_vllm))
                mm_t.append(timed(run_matmuls))
            distinct = int(torch.unique(ids).numel())
            floor = distinct * per_expert / read_bw
            results[count] = {"reference_ms": median(ref_t) * 1e3, "vllm_cpu_bf16_ms": median(vllm_t) * 1e3,
                              "bf16_floor_ms": floor * 1e3, "distinct_experts": distinct,
                              "reference_over_floor": median(ref_t) / floor,
                              "reference_over_vllm_bf16": median(ref_t) / median(vllm_t),
                              "max_rel_diff_vs_vllm": rel, "samples": reps,
                              "torch_bf16_matmuls_ms": median(mm_t) * 1e3,
                              "matmuls_over_floor": median(mm_t) / floor,
                              "reference_over_matmuls": median(ref_t) / median(mm_t)}
            if own is not None:
                _, layer = own  # type: ignore[misc]
                logits = logits_for(ids, weights)
                c = layer.forward(x, logits)  # warm-up, and the same answer?
                own_t = [timed(functools.partial(layer.forward, x, logits)) for _ in range(reps)]
                results[count].update({
                    "vllm_mxfp4_ms": median(own_t) * 1e3,
                    "reference_over_vllm_mxfp4": median(ref_t) / median(own_t),
                    "max_rel_diff_vllm_mxfp4_vs_reference": float((c.float() - a.float()).abs().max()
                                                                  / a.float().abs().max())})
    if own is not None:
        own[0].close()  # type: ignore[index]
    one, sixteen = results[1], results[16]
    within = max(one["reference_over_floor"], sixteen["reference_over_floor"])
    mxfp4_kernel = own_reason or (f"measured: {one['vllm_mxfp4_ms']:.1f} / {sixteen['vllm_mxfp4_ms']:.1f} ms "
                                  "(1 / 16 tokens, a real vLLM layer through MoERunner.forward)")
    return [Metric(
        "reference_decode_ms", one["reference_ms"], "ms", baseline=one["vllm_cpu_bf16_ms"],
        baseline_name="vLLM CPU MoE kernel (cpu_fused_moe, vec ISA) on the bf16 dequantised weights",
        ratio=one["reference_ms"] / one["vllm_cpu_bf16_ms"], ratio_means="quantreg / baseline (lower is better)",
        goal="report; stay within 1.5x of the bf16 bandwidth floor", goal_met=within <= 1.5,
        notes=[f"1 token: reference {one['reference_ms']:.1f} ms, vLLM bf16 kernel {one['vllm_cpu_bf16_ms']:.1f} ms, "
               f"bf16 floor {one['bf16_floor_ms']:.1f} ms ({one['distinct_experts']} experts)",
               f"16 tokens: reference {sixteen['reference_ms']:.1f} ms, vLLM bf16 kernel "
               f"{sixteen['vllm_cpu_bf16_ms']:.1f} ms, bf16 floor {sixteen['bf16_floor_ms']:.1f} ms "
               f"({sixteen['distinct_experts']} experts)",
               f"what limits it: torch's own bf16 matmuls for the same experts and token counts, alone, take "
               f"{one['torch_bf16_matmuls_ms']:.1f} / {sixteen['torch_bf16_matmuls_ms']:.1f} ms (x"
               f"{one['matmuls_over_floor']:.2f} / x{sixteen['matmuls_over_floor']:.2f} the floor): without "
               "AVX512-BF16 or AMX, torch converts bf16 to fp32 and the GEMM is compute-bound, so time grows with "
               "tokens per expert; the rest of the reference (routing, activation, weighted sum) costs x"
               f"{one['reference_over_matmuls']:.2f} / x{sixteen['reference_over_matmuls']:.2f} on top",
               f"read bandwidth {read_bw / 1e9:.1f} GB/s; vLLM MXFP4 kernel: {mxfp4_kernel}",
               f"load average at the end: {load_average()}"],
        extra={"tokens_1": one, "tokens_16": sixteen, "read_gb_s": read_bw / 1e9, "vllm_mxfp4_kernel": mxfp4_kernel,
               "vllm_mxfp4_ms": [one.get("vllm_mxfp4_ms"), sixteen.get("vllm_mxfp4_ms")],
               "display_value": f"{one['reference_ms']:.1f} / {sixteen['reference_ms']:.1f}",
               "display_baseline": f"{one['vllm_cpu_bf16_ms']:.1f} / {sixteen['vllm_cpu_bf16_ms']:.1f} (bf16); "
                                   f"floor {one['bf16_floor_ms']:.1f} / {sixteen['bf16_floor_ms']:.1f}",
               "display_ratio": f"{one['reference_over_vllm_bf16']:.2f} / {sixteen['reference_over_vllm_bf16']:.2f}; "
                                f"floor x{one['reference_over_floor']:.2f} / x{sixteen['reference_over_floor']:.2f}",
               "torch_threads": torch.get_num_threads()},
    )]


def main() -> None:
    child_main(run, __doc__)


if __name__ == "__main__":
    main()
