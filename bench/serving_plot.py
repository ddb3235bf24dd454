"""The serving bench's plot: output tokens/s and p99 inter-token latency against concurrent clients.

Why an SVG written by hand: the bench's environment is quantreg's own (no matplotlib, and the
project adds no plotting dependency for one figure); a static SVG is a text file docs/benchmarks.md
can embed and git can diff. One or more result JSONs of ``bench/serving_bench.py`` (e.g. 4 and 24
layers) become one figure of two panels side by side: total output tokens/s (left) and p99
inter-token latency in ms (right), both against clients on a log2 axis, one line per (server,
layers). Every point is a number in the JSON; nothing is smoothed or fitted.

Usage::

    python -m bench.serving_plot bench/results/serving-L4-avx512.json bench/results/serving-L24-avx512.json \\
        --out docs/img/serving-avx512.svg
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

W, H, PAD = 360, 260, 48  # one panel; PAD leaves room for the axes' labels
COLOURS = {"vLLM + quantreg": ("#1f77b4", "#6baed6"), "llama-server": ("#d62728", "#fc9272")}
PANELS = (("output_tok_s", "output tokens/s (total)"), ("itl_ms_p99", "inter-token latency p99 (ms)"))


def series(results: list[dict[str, Any]]) -> list[tuple[str, str, list[tuple[int, dict[str, Any]]]]]:
    """(label, colour, [(clients, level)]) per server and result, in the order given."""
    out = []
    for i, result in enumerate(results):
        for server, r in result["servers"].items():
            shades = COLOURS.get(server, ("#555555", "#999999"))
            out.append((f"{server}, {result['layers']} layers", shades[min(i, 1)],
                        [(lv["clients"], lv) for lv in r["levels"]]))
    return out


def _ticks(top: float) -> list[float]:
    """About five round ticks from 0 to ``top``."""
    if top <= 0:
        return [0.0]
    step = 10 ** math.floor(math.log10(top / 5))
    for m in (1, 2, 5, 10):
        if top / (step * m) <= 6:
            step *= m
            break
    return [step * k for k in range(int(top // step) + 2)]


def panel(x0: int, key: str, title: str, lines: list[tuple[str, str, list[tuple[int, dict[str, Any]]]]],
          clients: list[int]) -> list[str]:
    """One panel's SVG elements: axes, ticks, a polyline and dots per series."""
    values = [float(lv[key]) for _, _, pts in lines for _, lv in pts if lv.get(key) is not None]
    ticks = _ticks(max(values, default=1.0))
    top = ticks[-1] or 1.0
    lo, hi = math.log2(min(clients)), math.log2(max(clients))

    def x(c: int) -> float:
        return x0 + PAD + (W - 2 * PAD) * ((math.log2(c) - lo) / (hi - lo) if hi > lo else 0.5)

    def y(v: float) -> float:
        return H - PAD + 10 - (H - 2 * PAD) * v / top

    els = [f'<text x="{x0 + W / 2}" y="16" text-anchor="middle" font-size="13">{title}</text>',
           f'<line x1="{x0 + PAD}" y1="{y(0)}" x2="{x0 + W - PAD}" y2="{y(0)}" stroke="#000"/>',
           f'<line x1="{x0 + PAD}" y1="{y(0)}" x2="{x0 + PAD}" y2="{y(top)}" stroke="#000"/>',
           f'<text x="{x0 + W / 2}" y="{H - 4}" text-anchor="middle" font-size="11">concurrent clients</text>']
    for t in ticks:
        els.append(f'<text x="{x0 + PAD - 4}" y="{y(t) + 4}" text-anchor="end" font-size="10">{t:g}</text>')
        els.append(f'<line x1="{x0 + PAD}" y1="{y(t)}" x2="{x0 + W - PAD}" y2="{y(t)}" stroke="#ddd"/>')
    for c in clients:
        els.append(f'<text x="{x(c)}" y="{y(0) + 14}" text-anchor="middle" font-size="10">{c}</text>')
    for label, colour, pts in lines:
        xy = [(x(c), y(float(lv[key]))) for c, lv in pts if lv.get(key) is not None]
        if not xy:
            continue
        els.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" data-series="{label}" '
                   f'points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in xy)}"/>')
        els.extend(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{colour}"/>' for a, b in xy)
    return els


def svg(results: list[dict[str, Any]]) -> str:
    """The whole figure: two panels and a legend naming each series and the host kind."""
    lines = series(results)
    clients = sorted({c for _, _, pts in lines for c, _ in pts}) or [1]
    legend_h = 16 * len(lines) + 24
    els = []
    for i, (key, title) in enumerate(PANELS):
        els += panel(i * W, key, title, lines, clients)
    kinds = sorted({r["machine"]["host_kind"] for r in results})
    els.append(f'<text x="8" y="{H + 14}" font-size="11">host kind: {", ".join(kinds)}; '
               f'{results[0]["threads"] if results else "?"} threads; one pass per level</text>')
    for i, (label, colour, _) in enumerate(lines):
        yy = H + 30 + 16 * i
        els.append(f'<line x1="8" y1="{yy - 4}" x2="28" y2="{yy - 4}" stroke="{colour}" stroke-width="2"/>')
        els.append(f'<text x="34" y="{yy}" font-size="11">{label}</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{H + legend_h}" '
            f'font-family="sans-serif">\n' + "\n".join(els) + "\n</svg>\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("results", nargs="+", type=Path, help="serving_bench JSON files")
    p.add_argument("--out", type=Path, required=True, help="the SVG to write")
    args = p.parse_args(argv)
    results = []
    for path in args.results:
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"{path}: not a serving_bench result ({exc})") from None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(svg(results))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
