"""``resolve_us_10k``, ``load_validate_s_10k`` and ``pathological_tables_s``: the registry with synthetic tables.

Why synthetic tables: real ones hold a handful of rules, so the only way to show that lookups do
not scan the table and that loading stays linear is to grow it. The table mixes fully specific
rules, rules with value lists and wildcards, fallback chains through the installed plugin's
methods and rule options, so validation does all of its checks.

Baselines, measured side by side in this process:

* resolve: a linear scan over every rule (``Match.matches`` on each, then the documented
  precedence), i.e. a registry without :mod:`quantreg.index`;
* load + validate: the same ``Registry.build`` with the libyaml fast path switched off, i.e. PyYAML's
  pure-Python composer, which is what quantreg used before the fast path.

``pathological_tables_s`` (issue 12, class 4): tables an operator or a fuzzer can write that used
to cost seconds to minutes or gigabytes: a 3.7 KB rule with 220 values per match field (a 10.6 M
entry cross product), a legitimate 12,000-rule 1.5 MB table (refused as an "alias bomb"), a 4 MB
single-line flow list, 300 unknown method names against 10,000 table-defined methods, a 4 MB
alias bomb, and 12,000 rules sharing their chain and options through aliases. Each is built and
validated in a fresh child process (``Registry.build``, lenient), which reports its wall seconds
and peak RSS; the goal is <= 5 s and peak RSS growth <= 10x the file size over an empty-table child.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.common import Metric, child_main, interleave, median
from quantreg import Key, Registry
from quantreg.table import yamlfile

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
    return [resolve, load, pathological_metric()]


def wide_rule_text() -> str:
    """One rule naming 220 values on each match field (~3.7 KB): 220^3 = 10.6 M keys if expanded."""
    vals = ", ".join(f"v{i}" for i in range(220))
    return f"version: 1\nrules:\n  - match: {{quant_format: [{vals}], model_type: [{vals}], device: [{vals}]}}\n" \
           "    method: vllm\n"


def many_rules_text(rules: int = 12_000) -> str:
    """A legitimate table of ``rules`` distinct rules (~1.5 MB at 12,000), block style with notes."""
    lines = ["version: 1", "rules:"]
    for i in range(rules):
        lines += ["  - match:", f"      quant_format: format_{i:05d}", f"      model_type: [model_{i % 97}, other]",
                  "      device: [cpu, cuda]", "    method: [vllm]", f"    priority: {i % 7}",
                  f"    note: rule {i} of an ordinary table"]
    return "\n".join(lines) + "\n"


def flow_list_text(size: int = 4_000_000) -> str:
    """A valid table whose rule options hold one ~4 MB single-line flow list."""
    head = "version: 1\nrules:\n  - match: {}\n    method: vllm\n    options: {values: ["
    count = (size - len(head)) // 9
    return head + ", ".join(f"x{i:06d}" for i in range(count)) + "]}\n"


def alias_bomb_text(size: int = 4_000_000) -> str:
    """:func:`flow_list_text` with its list anchored and aliased once more: past the alias-expansion bound."""
    text = flow_list_text(size)
    return text.replace("options: {values:", "options: &o {values:", 1) + "  - match: {device: x}\n" \
        "    method: vllm\n    options: *o\n"


def anchored_rules_text(rules: int = 12_000) -> str:
    """A table whose rules share options and a chain through anchors (the libyaml path handles aliases)."""
    lines = ["version: 1", "rules:", "  - match: {quant_format: base}", "    method: &chain [vllm]",
             "    options: &opts {}"]
    for i in range(rules):
        lines += [f"  - match: {{quant_format: f{i:05d}, model_type: [m{i % 97}, other], device: cpu}}",
                  "    method: *chain", "    options: *opts", f"    priority: {i % 7}"]
    return "\n".join(lines) + "\n"


def unknown_methods_text(methods: int = 10_000, unknown: int = 300) -> str:
    """A user table defining ``methods`` methods and ``unknown`` rules naming methods that do not exist."""
    lines = ["version: 1", "allow_import_targets: true", "methods:"]
    lines += [f"  method_{i:05d}: {{target: 'qrt_none.module:Method{i}'}}" for i in range(methods)]
    lines += ["rules:"]
    lines += [f"  - {{match: {{quant_format: fmt{i}}}, method: methd_{i:05d}}}" for i in range(unknown)]
    return "\n".join(lines) + "\n"


PATHOLOGICAL = {"wide_rule_220_values": wide_rule_text, "rules_12000": many_rules_text,
                "flow_list_4mb": flow_list_text, "alias_bomb_4mb": alias_bomb_text,
                "anchored_rules_12000": anchored_rules_text,
                "unknown_300_vs_10000_methods": unknown_methods_text,
                "empty": lambda: "version: 1\nrules: []\n"}
_CHILD = """
import json, resource, sys, time
from quantreg import Registry
start, cpu = time.perf_counter(), time.process_time()
registry = Registry.build(config=[sys.argv[1]], entry_points=False)
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
longest = max((len(str(p)) for p in registry.problems), default=0)
# VmHWM, not ru_maxrss: the latter can carry the forking parent's peak across exec
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")]
rss = hwm[0] if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"s": seconds, "cpu_s": cpu, "rss_kb": rss,
                  "problems": len(registry.problems), "longest_message": longest,
                  "rules": len(registry.index.rules)}))
"""


def pathological(tmp: str) -> dict[str, dict[str, float]]:
    """Each pathological table built once in a fresh child: seconds, peak RSS, problems, longest message."""
    out: dict[str, dict[str, float]] = {}
    for name, make in PATHOLOGICAL.items():
        path = Path(tmp) / f"{name}.yaml"
        path.write_text(make())
        env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
        env["QUANTREG_CACHE_DIR"] = "off"
        child = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, env=env,
                               timeout=600)
        if child.returncode != 0:
            raise AssertionError(f"{name}: {child.stderr[-2000:]}")
        data = json.loads(child.stdout.splitlines()[-1])
        out[name] = {"file_bytes": path.stat().st_size, "seconds": data["s"], "cpu_seconds": data["cpu_s"],
                     "peak_rss_mb": data["rss_kb"] / 1024,
                     "problems": data["problems"], "longest_message_chars": data["longest_message"],
                     "rules": data["rules"]}
    base = out.pop("empty")["peak_rss_mb"]
    for row in out.values():
        row["rss_growth_mb"] = row["peak_rss_mb"] - base
        row["rss_growth_over_size"] = row["rss_growth_mb"] * 2**20 / row["file_bytes"]
    return out


def pathological_metric() -> Metric:
    with tempfile.TemporaryDirectory(prefix="quantreg-bench-") as tmp:
        rows = pathological(tmp)
    worst = max(rows.values(), key=lambda r: r["seconds"])
    met = all(r["seconds"] <= 5 and r["rss_growth_over_size"] <= 10 for r in rows.values())
    return Metric(
        "pathological_tables_s", worst["seconds"], "s", goal="<= 5 s and RSS growth <= 10x file size, every case",
        goal_met=met,
        notes=["each table built and validated once (Registry.build, lenient, no entry points, cache off) in a "
               "fresh child; value = slowest case (wall); cpu_seconds alongside, as wall time on a loaded "
               "2-core machine varies several-fold; RSS growth over an empty-table child"],
        extra={"cases": rows},
    )


def main() -> None:
    child_main(run, __doc__)


if __name__ == "__main__":
    main()
