"""Whole-model results for people: fixed and per-layer costs, the 24-layer extrapolation, a plot.

    python bench/wholemodel_report.py bench/results/wholemodel-L2.json bench/results/wholemodel-L4.json \
        [--png docs/img/wholemodel.png] [--markdown OUT.md]

Why: a 2-core 24 GB host cannot keep GPT-OSS-20B's 24 layers alive in three engines at once, so the
comparison is measured at few layers (same run, engines interleaved) and extrapolated. A decode step
is ``fixed + layers x per_layer`` for every engine (the lm_head, the token pick and the scheduler are
paid once per step; each layer adds its attention and its routed experts), so two or more layer
counts give both terms (a least-squares line; its residuals say how linear the runs were), and a
24-layer step is ``fixed + 24 x per_layer``. A run at 24 layers itself is shown beside the line.
Prefill is extrapolated the same way on the seconds per 512-token prompt. Standard library only,
plus matplotlib for ``--png`` (run it with an interpreter that has it, e.g. the llama environment
of ``bench/llama_setup.sh`` after ``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

TARGET_LAYERS = 24


def load(paths: list[Path]) -> list[dict[str, Any]]:
    results = [json.loads(p.read_text()) for p in paths]
    return sorted(results, key=lambda r: int(r["layers"]))


def fit(results: list[dict[str, Any]], label: str, key: str) -> dict[str, float | list[int] | list[float]] | None:
    """``fixed`` and ``per_layer`` seconds of one engine's step (decode) or prompt (prefill): a
    least-squares line through every layer count that measured it (two points give the line
    through both), with each point's residual, so a third layer count shows whether the step is
    really linear in layers or one run was disturbed."""
    points = [(int(r["layers"]), r["engines"][label]) for r in results if label in r["engines"]]
    layers = sorted({a for a, _ in points})
    if len(layers) < 2:
        return None
    xs: list[float] = []
    ts: list[float] = []
    for a, rec in points:
        xs.append(float(a))
        if key == "decode":
            ts.append(1.0 / rec["decode_tok_s"])
        else:
            ts.append(rec["settings_prefill"] / rec["prefill_tok_s"])
    n = len(xs)
    mx, mt = sum(xs) / n, sum(ts) / n
    per_layer = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sum((x - mx) ** 2 for x in xs)
    fixed = mt - per_layer * mx
    residuals = [t - (fixed + per_layer * x) for x, t in zip(xs, ts)]
    return {"from_layers": [int(x) for x in xs], "t": ts, "residual_s": residuals, "per_layer_s": per_layer,
            "fixed_s": fixed, "at_target_s": fixed + TARGET_LAYERS * per_layer}


def extrapolate(results: list[dict[str, Any]]) -> dict[str, Any]:
    for r in results:
        for e in r["engines"].values():
            e["settings_prefill"] = r["settings"]["prefill_tokens"]
    labels = list(dict.fromkeys(label for r in results for label in r["engines"]))
    out: dict[str, Any] = {}
    for label in labels:
        d, p = fit(results, label, "decode"), fit(results, label, "prefill")
        if d is None or p is None:
            continue
        prefill_tokens = results[-1]["settings"]["prefill_tokens"]
        out[label] = {"decode": d, "prefill": p, "decode_tok_s_24": 1.0 / d["at_target_s"],
                      "prefill_tok_s_24": prefill_tokens / p["at_target_s"]}
    return out


def markdown(results: list[dict[str, Any]], extra: dict[str, Any]) -> str:
    lines = []
    for r in results:
        m = r["machine"]
        lines.append(f"**{r['layers']} layers** ({m['host_kind']} host kind, {m['logical_cpus']} CPUs, "
                     f"{r['settings']['threads']} threads; read bandwidth {r['read_bandwidth_gb_s']:.1f} GB/s; "
                     f"load average {m['load_averages'][0]} -> {m['load_averages'][-1]}; "
                     f"{r['settings']['rounds']} interleaved rounds, medians; run {r['duration_s']:.0f} s)")
        lines.append("")
        lines.append("| engine | decode tok/s | prefill 512 tok/s | TTFT ms | start-up s | MB read/token | "
                     "of bandwidth | peak RSS GB |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for label, e in r["engines"].items():
            repack = e.get("startup_split", {}).get("moe_repack_s")
            start = f"{e['startup_s']:.1f}" + (f" (MoE repack {repack:.1f})" if repack else "")
            lines.append(f"| {label} | {e['decode_tok_s']:.2f} | {e['prefill_tok_s']:.1f} | {e['ttft_s'] * 1e3:.0f} | "
                         f"{start} | {e['bytes_per_token'] / 1e6:.0f} | {e['bandwidth_fraction']:.0%} | "
                         f"{(e.get('peak_rss_bytes') or 0) / 1e9:.2f} |")
        lines.append("")
        for name, ratio in r["ratios"].items():
            lines.append(f"- {name}: decode **x{ratio['decode']:.2f}**, prefill **x{ratio['prefill']:.2f}**, "
                         f"TTFT x{ratio['ttft']:.2f}")
        for label, e in r["engines"].items():
            if "split" in e:
                s = e["split"]
                lines.append(f"- {label}, one decode step {s['step_ms']:.1f} ms: MoE {s['moe_ms']:.1f} ms, "
                             f"attention + dense linear {s['attention_dense_ms']:.1f} ms, lm_head "
                             f"{s['lm_head_ms']:.1f} ms, the rest (scheduler, sampling, Python) {s['rest_ms']:.1f} ms")
        lines.append("")
    if extra:
        lines.append(f"**Extrapolated to {TARGET_LAYERS} layers** (step = fixed + layers x per_layer, a least-squares "
                     "line through the layer counts above; the largest residual says how far one run sits off it):")
        lines.append("")
        lines.append("| engine | layer counts | decode: fixed ms + per layer ms | largest residual ms "
                     "| decode tok/s at 24 | prefill: fixed s + per layer s | prefill tok/s at 24 |")
        lines.append("|---|---|---|---|---|---|---|")
        for label, x in extra.items():
            d, p = x["decode"], x["prefill"]
            worst = max(abs(v) for v in d["residual_s"]) * 1e3
            lines.append(f"| {label} | {', '.join(str(n) for n in d['from_layers'])} | "
                         f"{d['fixed_s'] * 1e3:.1f} + {d['per_layer_s'] * 1e3:.2f} x L | {worst:.1f} | "
                         f"{x['decode_tok_s_24']:.2f} | {p['fixed_s']:.3f} + {p['per_layer_s']:.3f} x L | "
                         f"{x['prefill_tok_s_24']:.1f} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], extra: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = results[-1]
    labels = list(r["engines"])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    short = [label.replace(" (registry's choice)", "").replace("llama.cpp, dense ", "llama.cpp ") for label in labels]
    colors = ["#1f77b4" if r["engines"][lb]["kind"] == "vllm" else "#ff7f0e" for lb in labels]
    series = [("decode tokens/s", "decode_tok_s", "decode_tok_s_24"),
              ("prefill (512) tokens/s", "prefill_tok_s", "prefill_tok_s_24")]
    for ax, (title, key, key24) in zip(axes[:2], series):
        measured = [r["engines"][lb][key] for lb in labels]
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], measured, 0.4, color=colors, label=f"measured, {r['layers']} layers")
        if extra:
            ax.bar([x + 0.2 for x in xs], [extra.get(lb, {}).get(key24, 0) for lb in labels], 0.4, color=colors,
                   alpha=0.45, hatch="//", label=f"extrapolated, {TARGET_LAYERS} layers")
        ax.set_xticks(list(xs), short, rotation=12, fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=7)
    ax = axes[2]
    ax.bar(range(len(labels)), [r["engines"][lb]["bandwidth_fraction"] for lb in labels], color=colors)
    ax.set_xticks(list(range(len(labels))), short, rotation=12, fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_title(f"decode: fraction of read bandwidth ({r['read_bandwidth_gb_s']:.1f} GB/s)")
    fig.suptitle(f"GPT-OSS-20B width, same weights, {r['settings']['threads']} threads, host kind "
                 f"{r['machine']['host_kind']}", fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--png", type=Path)
    p.add_argument("--markdown", type=Path)
    args = p.parse_args(argv)
    results = load(args.results)
    extra = extrapolate(results)
    text = markdown(results, extra)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    print(text)
    if args.png:
        plot(results, extra, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
