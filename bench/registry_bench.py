"""``resolve_us_10k`` and ``load_validate_s_10k``: the registry with synthetic 100 / 1k / 10k-rule tables.

Why synthetic tables: real ones hold a handful of rules, so the only way to show that lookups do
not scan the table and that loading stays linear is to grow it. The table mixes fully specific
rules, rules with value lists and wildcards, fallback chains through the installed plugin's
methods and rule options, so validation does all of its checks.

Baselines, measured side by side in this process:

* resolve: a linear scan over every rule (``Match.matches`` on each, then the documented
  precedence), i.e. a registry without :mod:`quantreg.index`;
* load + validate: the same ``Registry.build`` with the libyaml fast path switched off, i.e. PyYAML's
  pure-Python composer, which is what quantreg used before the fast path.
"""

from __future__ import annotations

import functools
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.common import Metric, child_main, interleave, median
from quantreg import Key, Registry, yamlfile

SIZES = (100, 1_000, 10_000)
MODELS = 97  # model_type values cycle through this many names


def table_text(rules: int) -> str:
    """A valid, unambiguous table of ``rules`` rules (every quant_format is unique, so no ties)."""
    lines = ["# synthetic quantreg table for bench/registry_bench.py", "version: 1", "rules:"]
    for i in range(rules):
        kind = i % 10
        if kind == 9:  # a value list, a wildcard and a fallback chain through the plugin's methods
            lines += [f"  - match: {{quant_format: fmt{i}, device: [cpu, cuda, hpu]}}",
                      "    method: [hpu_mxfp4, hpu_mxfp4_dequant, vllm]",
                      "    options: {alpha: 1.702, limit: 7.0}",
                      f"    note: synthetic rule {i} with a chain"]
        elif kind == 8:  # block style, a priority
            lines += ["  - match:",
                      f"      quant_format: fmt{i}",
                      f"      model_type: model{i % MODELS}",
                      "    method: vllm",
                      "    priority: 5"]
        else:
            lines += [f"  - match: {{quant_format: fmt{i}, model_type: model{i % MODELS}, device: cpu}}",
                      "    method: vllm"]
    return "\n".join(lines) + "\n"


def keys_for(rules: int, count: int) -> list[Key]:
    """``count`` distinct keys spread over the table (each one resolved once, so never cached)."""
    step = max(1, rules // count)
    keys: list[Key] = []
    for i in range(0, rules, step):
        device = "cuda" if i % 10 == 9 else "cpu"
        keys.append(Key(f"fmt{i}", f"model{i % MODELS}", device))
    keys.append(Key("no_such_format", "gpt_oss", "cpu"))  # falls through to the default rule
    return keys[:count]


@contextmanager
def pure_python_yaml() -> Iterator[None]:
    """Route every table through PyYAML's pure-Python composer (the pre-fast-path behaviour)."""
    saved = yamlfile._fast_path_safe
    yamlfile._fast_path_safe = lambda text: False
    try:
        yield
    finally:
        yamlfile._fast_path_safe = saved


def build(path: Path) -> Registry:
    registry = Registry.build(config=[path])
    if registry.problems:
        raise AssertionError(f"synthetic table has problems: {registry.problems[:3]}")
    return registry


def build_pure(path: Path) -> Registry:
    with pure_python_yaml():
        return build(path)


def linear_resolve(registry: Registry, key: Key) -> str:
    """The baseline: scan every rule, keep the best by (layer, specificity, priority, file order)."""
    best = None
    best_rank: tuple[int, int, int] | None = None
    for rule in registry.index.rules:
        if rule.match.matches(key) and (best_rank is None or rule.rank > best_rank):
            best, best_rank = rule, rule.rank
    return best.methods[0] if best is not None else "vllm"


def resolve_times(registry: Registry, keys: list[Key]) -> list[float]:
    out = []
    for key in keys:
        start = time.perf_counter()
        registry.resolve(key)
        out.append(time.perf_counter() - start)
    return out


def run(quick: bool) -> list[Metric]:
    growth: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="quantreg-bench-") as tmp:
        for size in SIZES:
            path = Path(tmp) / f"table_{size}.yaml"
            path.write_text(table_text(size))
            reps = (3 if quick else 7) if size == 10_000 else (5 if quick else 9)
            reps_pure = (1 if quick else 3) if size == 10_000 else (3 if quick else 5)
            load_s, load_pure = interleave(functools.partial(build, path), functools.partial(build_pure, path), reps,
                                           reps_pure)
            cpu = []
            for _ in range(2 if quick else 3):
                start = time.thread_time()
                build(path)
                cpu.append(time.thread_time() - start)
            registry = build(path)
            assert len(registry.index.rules) >= size
            keys = keys_for(size, 500 if quick else 2000)
            registry.resolve(keys[0])  # probes of the chain's methods, cached per (method, device)
            indexed = resolve_times(registry, keys[1:])
            scan_keys = keys[1: 1 + (50 if size == 10_000 and quick else 200)]
            scan = []
            for key in scan_keys:
                start = time.perf_counter()
                linear_resolve(registry, key)
                scan.append(time.perf_counter() - start)
            for key in scan_keys:  # same answer as the index (sanity, not timed)
                assert registry.resolve(key).method == "vllm" or key.device == "cuda"
            growth[str(size)] = {
                "rules": len(registry.index.rules),
                "load_validate_s": median(load_s),
                "load_validate_cpu_s": median(cpu),
                "load_validate_pure_python_s": median(load_pure),
                "resolve_us": median(indexed) * 1e6,
                "resolve_p90_us": sorted(indexed)[int(0.9 * len(indexed))] * 1e6,
                "resolve_linear_scan_us": median(scan) * 1e6,
                "samples_load": len(load_s),
                "samples_load_pure_python": len(load_pure),
                "samples_resolve": len(indexed),
            }
    g10 = growth["10000"]
    resolve = Metric(
        "resolve_us_10k", g10["resolve_us"], "us", baseline=g10["resolve_linear_scan_us"],
        baseline_name="linear scan over all rules (no index)",
        ratio=g10["resolve_us"] / g10["resolve_linear_scan_us"], ratio_means="quantreg / baseline (lower is better)",
        goal="<= 1000 us", goal_met=g10["resolve_us"] <= 1000,
        notes=["uncached: every key is resolved once on a registry holding the synthetic table plus the default "
               "and plugin tables; the full Decision (candidates, chain walk) is built"],
        extra={"growth": {n: {k: v for k, v in g.items() if "resolve" in k or k == "rules"}
                          for n, g in growth.items()}},
    )
    load = Metric(
        "load_validate_s_10k", g10["load_validate_s"], "s", baseline=g10["load_validate_pure_python_s"],
        baseline_name="same build, PyYAML pure-Python composer (before the libyaml fast path)",
        ratio=g10["load_validate_s"] / g10["load_validate_pure_python_s"],
        ratio_means="quantreg / baseline (lower is better)",
        goal="<= 1 s", goal_met=g10["load_validate_s"] <= 1.0,
        notes=["Registry.build(config=[table]): plugin entry points, default + plugin + synthetic tables, schema "
               "and method checks, ambiguity search, index; wall-clock median, CPU time in growth"],
        extra={"growth": {n: {k: v for k, v in g.items() if "load" in k or k == "rules"} for n, g in growth.items()}},
    )
    return [resolve, load]


def main() -> None:
    child_main(run, __doc__)


if __name__ == "__main__":
    main()
