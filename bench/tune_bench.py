"""``tune_20b_*``: what ``quantreg tune`` measures for each method at the GPT-OSS-20B layer shape.

Why a bench of its own: which MXFP4 method is fastest *and* correct depends on the host kind
(vLLM's own CPU kernel, ``CPUExpertsMxfp4``, exists only where AMX does; plugin #2's kernel is
tuned for decode), and ``quantreg tune`` is the tool an operator runs to find out. This runs it
exactly as the operator would (``python -m quantreg tune DIR --synthetic --json``, a fresh
process) on a one-layer checkpoint of 20B width (E=32, H=I=2880, top-4; random valid MXFP4
weights), and reports, per method that passed tune's float64 check: its medians at 1 / 64 / 256
tokens (tune interleaves the methods round by round) and its decode-weighted score against the
baseline: vLLM's own method where it runs, else ``mxfp4_reference``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import ROOT, Metric, child_main, python_env

SHAPE = {"experts": 32, "hidden": 2880, "intermediate": 2880, "top_k": 4}


def run_tune(budget: float) -> dict[str, Any]:
    """One ``quantreg tune`` at 20B width; its JSON answer."""
    from quantreg.tiny.checkpoint import write_tiny_gpt_oss

    with tempfile.TemporaryDirectory(prefix="quantreg-bench-tune-") as tmp:
        model = write_tiny_gpt_oss(Path(tmp) / "model", layers=1, vocab=256, heads=4, kv_heads=2, **SHAPE)
        proc = subprocess.run([sys.executable, "-m", "quantreg", "tune", str(model), "--synthetic", "--budget",
                               str(budget), "--out", str(Path(tmp) / "tuned.yaml"), "--json"], cwd=ROOT,
                              env=python_env(), capture_output=True, text=True, timeout=budget * 3 + 300,
                              stdin=subprocess.DEVNULL, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"quantreg tune failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                               f"{proc.stderr[-4000:]}")
        data: dict[str, Any] = json.loads(proc.stdout)
        return data


def run(quick: bool) -> list[Metric]:
    data = run_tune(40.0 if quick else 120.0)
    results = {r["method"]: r for r in data["results"]}
    passed = {m: r for m, r in results.items() if r["ok"]}
    base_name = "vllm" if "vllm" in passed else "mxfp4_reference"
    base = passed.get(base_name)
    why_not_vllm = "" if "vllm" in passed else f"; vLLM's own method: {results.get('vllm', {}).get('error', 'absent')}"
    metrics = []
    for method in data["chain"]:
        r = passed[method]
        ms = r["ms"]
        baseline = base["score_ms"] if base is not None else None
        per_tokens = ", ".join(
            f"{t} tok {ms[t]:.2f} ms" + (f" (x{base['ms'][t] / ms[t]:.2f} vs {base_name})"
                                         if base is not None and method != base_name else "")
            for t in sorted(ms, key=int))
        metrics.append(Metric(
            f"tune_20b_{method}", r["score_ms"], "ms", baseline=baseline, baseline_name=f"{base_name} (same run)",
            ratio=None if baseline is None else baseline / r["score_ms"],
            ratio_means=f"speed-up over {base_name} (its score / this method's score)",
            notes=[f"tune's score: decode-weighted geometric mean of the medians (0.5 / 0.25 / 0.25); {per_tokens}",
                   f"relative error vs float64 {r['rel_error']:.2g} (tolerance {data['tuned']['tolerance']}); "
                   f"rank {data['chain'].index(method) + 1} of {len(data['chain'])} in tune's chain "
                   f"{data['chain']}; {data['rounds']} rounds{why_not_vllm}"],
            extra={"ms": ms, "rel_error": r["rel_error"], "chain": data["chain"], "rounds": data["rounds"],
                   "host": data["tuned"]["host"], "shape": SHAPE},
        ))
    return metrics


if __name__ == "__main__":
    child_main(run, __doc__)
