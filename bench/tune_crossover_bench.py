"""``tune_crossover_20b``: where ``quantreg tune`` splits the 20B-shaped MoE key by token count, with the curve.

Why: on an AMX host vLLM's own MXFP4 kernel (``CPUExpertsMxfp4``) is slower than plugin #2's
``cpu_mxfp4`` at 1 token and much faster at 256 (bench/results/tune-amx.json), so one method per
key leaves one phase slow. This runs ``quantreg tune`` as an operator would (``python -m quantreg
tune DIR --synthetic --json``, a fresh process, the default token counts 1, 2, 4, ... 512) on a
one-layer checkpoint of GPT-OSS-20B width (E=32, H=I=2880, top-4; random valid MXFP4 weights)
and keeps everything tune decided by: the curve (per method per token count: median ms and the
interquartile spread over the median), the crossover (or why none), the envelope check (what the
written rules give each count against the fastest method there) and the table text written.

The metric's value is the envelope's worst ratio to the best method over every measured count
(goal: at most 1.05, the issue's 5 %); the baseline is the same ratio for the single method tune
would write without a split (its decode-weighted winner).
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
    """One ``quantreg tune`` at 20B width; its JSON answer plus the table text it wrote."""
    from quantreg.tiny.checkpoint import write_tiny_gpt_oss

    with tempfile.TemporaryDirectory(prefix="quantreg-bench-tune-crossover-") as tmp:
        model = write_tiny_gpt_oss(Path(tmp) / "model", layers=1, vocab=256, heads=4, kv_heads=2, **SHAPE)
        out = Path(tmp) / "tuned.yaml"
        proc = subprocess.run([sys.executable, "-m", "quantreg", "tune", str(model), "--synthetic", "--budget",
                               str(budget), "--out", str(out), "--json"], cwd=ROOT, env=python_env(),
                              capture_output=True, text=True, timeout=budget * 4 + 600, stdin=subprocess.DEVNULL,
                              check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"quantreg tune failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                               f"{proc.stderr[-4000:]}")
        data: dict[str, Any] = json.loads(proc.stdout)
        data["table"] = out.read_text()
        return data


def run(quick: bool) -> list[Metric]:
    data = run_tune(60.0 if quick else 180.0)
    decided = data["split"]
    cross = decided["crossover"]
    single = decided["single_envelope"]
    chosen = cross["envelope"] if cross else single
    rules = "; ".join(f"tokens {r['match'].get('tokens', 'any')}: {r['method']}" for r in data["rules"])
    return [Metric(
        "tune_crossover_20b", chosen["worst_ratio"], "x best", baseline=single["worst_ratio"],
        baseline_name=f"one method for every count ({decided['single']})",
        ratio=single["worst_ratio"] / chosen["worst_ratio"],
        ratio_means="the single method's worst ratio to the best / the written rules' (higher: the split helps more)",
        goal="the written rules within 5 % of the best method at every measured token count",
        goal_met=bool(chosen["ok"] and chosen["worst_ratio"] <= 1.05),
        notes=[decided["text"], f"rules written: {rules}", f"{data['rounds']} rounds, {data['elapsed_s']} s, "
               f"load {data['tuned']['load_avg']}"],
        extra={"tokens": data["tokens"], "curve": data["curve"], "split": decided, "rules": data["rules"],
               "table": data["table"], "results": data["results"], "rounds": data["rounds"],
               "elapsed_s": data["elapsed_s"], "budget_s": data["budget_s"], "shape": SHAPE,
               "host": data["tuned"]["host"], "load_avg": data["tuned"]["load_avg"]},
    )]


if __name__ == "__main__":
    child_main(run, __doc__)
