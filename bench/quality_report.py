"""The quality bench's markdown table and plot, from its JSON (:mod:`bench.quality_bench`).

    python -m bench.quality_report bench/results/quality-L24-avx512.json [--svg docs/quality-L24.svg]

The plot is a small hand-written SVG (the bench environment has no matplotlib): per weight set, one
row per engine, mean KL and p99 KL as bars on a log scale, the exact path's bf16 rounding as a line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any


def _e(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def rows(data: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(weight set, engine label, metrics) for every measured row, the bf16 reference first."""
    out = []
    for name, ws in data.get("weights", {}).items():
        out.append((name, "exact path rounded to bf16 (reference for 'bf16 rounding')", ws["bf16ref"]))
        for result in ws["engines"].values():
            if "metrics" in result:
                out.append((name, result["label"], result["metrics"]))
    return out


def markdown(data: dict[str, Any]) -> str:
    lines = [f"Quality, {data['layers']} layers, shape {data['shape']}, host kind {data['machine'].get('host_kind')}, "
             f"vLLM {data['vllm_mode']}; KL(exact || engine) per position, full vocabulary", "",
             "| weights | engine | mean KL | median | p99 | p99.9 | max | same top | mean KL by set (text / random / "
             "delimited) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, label, m in rows(data):
        sets = m.get("sets", {})
        by_set = " / ".join(_e(sets[s]["kl_mean"]) for s in ("text", "random", "delimited") if s in sets)
        lines.append(f"| {name} | {label} | {_e(m['kl_mean'])} | {_e(m['kl_median'])} | {_e(m['kl_p99'])} | "
                     f"{_e(m['kl_p999'])} | {_e(m['kl_max'])} | {100 * m['same_top']:.2f} % | {by_set} |")
    for name, ws in data.get("weights", {}).items():
        c = ws["exact_check"]
        lines.append("")
        lines.append(f"{name}: {ws['positions']} positions; exact path (fp32) against its float64 check on "
                     f"{c['positions']} positions: max KL {_e(c['kl_max'])}, max |d logprob| "
                     f"{_e(c['max_abs_logprob_diff'])}, same top {100 * c['same_top']:.2f} %.")
        bad = {k: r.get("error") or r.get("skipped") for k, r in ws["engines"].items() if "metrics" not in r}
        for key, why in bad.items():
            lines.append(f"{name}: {key} not measured: {str(why).splitlines()[0][:300]}")
    return "\n".join(lines)


def svg(data: dict[str, Any]) -> str:
    """Bars of mean and p99 KL per engine (log scale), one panel per weight set."""
    items = rows(data)
    values = [v for _, _, m in items for v in (m["kl_mean"], m["kl_p99"]) if v > 0]
    lo = math.floor(math.log10(min(values))) if values else -8
    hi = math.ceil(math.log10(max(values))) if values else 0
    hi = max(hi, lo + 1)
    left, width, row_h = 430, 420, 26
    height = 60 + row_h * len(items) + 30 * len(data.get("weights", {}))

    def x(v: float) -> float:
        return left + width * (math.log10(max(v, 10.0 ** lo)) - lo) / (hi - lo)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{height}" '
           'font-family="sans-serif" font-size="11">',
           f'<text x="10" y="18" font-size="13">KL(exact || engine) per position, {data["layers"]} layers '
           f'({data["shape"]}): mean (dark) and p99 (light), log scale</text>']
    for p in range(lo, hi + 1):
        out.append(f'<line x1="{x(10.0 ** p):.1f}" y1="30" x2="{x(10.0 ** p):.1f}" y2="{height - 10}" stroke="#ddd"/>')
        out.append(f'<text x="{x(10.0 ** p) - 12:.1f}" y="42">1e{p}</text>')
    y = 50
    current = None
    for name, label, m in items:
        if name != current:
            current = name
            y += 20
            out.append(f'<text x="10" y="{y}" font-weight="bold">{name} weights</text>')
            y += 6
        out.append(f'<text x="10" y="{y + 15}">{label[:68]}</text>')
        out.append(f'<rect x="{left}" y="{y + 3}" width="{x(m["kl_p99"]) - left:.1f}" height="18" fill="#9ecae1"/>')
        out.append(f'<rect x="{left}" y="{y + 7}" width="{x(m["kl_mean"]) - left:.1f}" height="10" fill="#08519c"/>')
        y += row_h
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, nargs="+")
    parser.add_argument("--svg", type=Path)
    args = parser.parse_args()
    for path in args.json:
        data = json.loads(path.read_text())
        print(markdown(data))
        print()
        if args.svg:
            args.svg.write_text(svg(data))
            print(f"wrote {args.svg}", file=sys.stderr)


if __name__ == "__main__":
    main()
