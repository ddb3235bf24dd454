"""Run every quantreg benchmark, print one table, write JSON.

    python bench/run.py [--quick] [--json PATH] [--only GROUP ...]

Groups run one after another, each in a fresh Python process (:mod:`bench.child`), so they do not
disturb each other's memory or imports; inside a group every ratio is measured side by side
(interleaved A/B). ``--quick`` (about 3 minutes here) uses fewer repetitions and fewer fresh
processes; the full run (well under 20 minutes) uses more. Results: ``{"metrics": {NAME: {"value",
"baseline", "ratio", "unit", ...}}, "machine": {...}}``, by default in ``bench/results/latest.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, load_average, machine, python_env, run_python

GROUPS: dict[str, list[str]] = {
    "hook": ["hook_bench"],
    "registry": ["registry_bench"],
    "dequant": ["dequant_bench"],
    "moe": ["decode_bench", "pwal_bench"],
    "vllm": ["vllm_bench"],
    "verify": ["verify_bench"],
    "cpu_mxfp4": ["cpu_mxfp4_bench"],
    "cpu_mxfp4_speed": ["cpu_mxfp4_speed_bench"],
    "tune": ["tune_bench"],
    "tune_repro": ["tune_repro_bench"],
    "tune_crossover": ["tune_crossover_bench"],
    "tokens_split": ["tokens_split_bench"],
}
ORDER = ["hook_ms", "register_import_ms", "resolve_us_10k", "load_validate_s_10k", "dequant_speedup",
         "dequant_bw_fraction", "reference_decode_ms", "hpu_pwal_ms_120b", "decode_ratio",
         "verify_decode_ratio", "tokens_split_decode_ratio", "tokens_split_layer_decode_ratio",
         "cpu_mxfp4_floor_ratio", "cpu_mxfp4_floor_ratio_120b", "cpu_mxfp4_tokens_16_256",
         "cpu_mxfp4_vs_vllm_bf16", "cpu_mxfp4_decode_floor_ratio",
         "cpu_mxfp4_prefill_gflops", "tune_20b_vllm", "tune_20b_cpu_mxfp4", "tune_20b_mxfp4_reference",
         "tune_repro_tiny", "tune_repro_20b", "tune_crossover_20b"]
DEFAULT_JSON = ROOT / "bench" / "results" / "latest.json"


def run_group(name: str, quick: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"quantreg-bench-{name}-") as tmp:
        out = Path(tmp) / "metrics.json"
        args = ["-m", "bench.child", *GROUPS[name], "--out", str(out)] + (["--quick"] if quick else [])
        run_python(args, env=python_env(), timeout=1800)
        metrics: dict[str, Any] = json.loads(out.read_text())
        return metrics


def _num(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("tokens/s",):
        return f"{value:,.0f} {unit}"
    if unit in ("fraction", ""):
        return f"{value:.3f}"
    if abs(value) >= 100:
        return f"{value:,.0f} {unit}"
    if abs(value) >= 10:
        return f"{value:.1f} {unit}"
    return f"{value:.3g} {unit}"


def rows(metrics: dict[str, Any]) -> list[list[str]]:
    out = []
    for name in [n for n in ORDER if n in metrics] + sorted(set(metrics) - set(ORDER)):
        m = metrics[name]
        value = m.get("display_value") or _num(m["value"], m["unit"])
        if m.get("display_value"):
            value = f"{value} {m['unit']}"
        baseline = m.get("display_baseline") or _num(m["baseline"], m.get("baseline_unit") or m["unit"])
        ratio = m.get("display_ratio") or ("-" if m["ratio"] is None else f"{m['ratio']:.3g}")
        met = m.get("goal_met")
        goal = m.get("goal") or "-"
        verdict = "" if met is None else (" (met)" if met else " (NOT met)")
        out.append([name, value, f"{baseline} ({m.get('baseline_name', '')})", ratio, goal + verdict])
    return out


def table(metrics: dict[str, Any]) -> str:
    """A Markdown table: it reads in a terminal and pastes into the README."""
    header = ["metric", "quantreg", "baseline", "ratio", "goal"]
    body = rows(metrics)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in body]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (about 3 minutes here)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"where to write results ({DEFAULT_JSON})")
    parser.add_argument("--only", nargs="+", choices=sorted(GROUPS), help="run only these groups")
    args = parser.parse_args(argv)
    started = time.time()
    info = machine()
    metrics: dict[str, Any] = {}
    failures: dict[str, str] = {}
    durations: dict[str, float] = {}
    for name in args.only or list(GROUPS):
        t0 = time.perf_counter()
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        try:
            metrics.update(run_group(name, args.quick))
        except Exception as exc:  # keep going: one broken group must not hide the others' numbers
            failures[name] = f"{type(exc).__name__}: {exc}"[-4000:]
            print(f"[bench] {name} FAILED: {failures[name][-1500:]}", file=sys.stderr, flush=True)
        durations[name] = round(time.perf_counter() - t0, 1)
        print(f"[bench] {name} done in {durations[name]} s", file=sys.stderr, flush=True)
    info["load_average_at_end"] = load_average()
    for row in metrics.values():  # every figure carries the host kind it was measured on
        if isinstance(row, dict):
            row.setdefault("host_kind", info["host_kind"])
    result = {
        "metrics": metrics,
        "machine": info,
        "mode": "quick" if args.quick else "full",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "group_durations_s": durations,
        "failures": failures,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(table(metrics))
    print(f"\n{result['mode']} run, {result['duration_s']} s on {info['cpu']} (host kind {info['host_kind']}, "
          f"{info['logical_cpus']} CPUs, "
          f"load {info['load_average_at_start']} -> {info['load_average_at_end']}); JSON: {args.json}")
    loads = [x[0] for x in (info["load_average_at_start"], info["load_average_at_end"]) if x]
    busiest = max(loads, default=0.0)
    if busiest > 0.75 * (info["logical_cpus"] or 1):
        print(f"WARNING: load average reached {busiest:.1f} on {info['logical_cpus']} CPUs: other work shared the "
              "machine, so absolute numbers are inflated (the side-by-side ratios less so)")
    for name, error in failures.items():
        print(f"FAILED group {name}: {error.splitlines()[0] if error else ''}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
