"""``hook_ms`` and ``register_import_ms``: quantreg's cost at vLLM start-up, in fresh processes.

Why fresh processes: ``register()`` runs once per vLLM process, with cold module caches and an
empty registry, after vLLM itself has been imported; a warm loop in one process would measure
something vLLM never does. Each child (:mod:`bench.hook_child`) imports vLLM, then does what
``vllm.plugins.load_general_plugins`` does for quantreg: load the entry point and call it.
Python's ``-X importtime`` report, bracketed by markers, gives the imports ``register()`` caused;
it runs in children of its own, because timing every import (and writing a line per import to a
pipe) slows the imports it measures: ``hook_ms`` is timed in plain children, as vLLM runs.

What is measured is the install in this interpreter's environment: children run
``bench/hook_child.py`` by path from a directory outside the checkout, with the checkout off
``PYTHONPATH``, so a wheel install is timed as a wheel (site-packages) and ``pip install -e .`` as
editable (the source tree through its ``.pth``). Each result says which (``install``), the tables'
names in the fingerprint (the same under both installs) and how many full metadata scans ran (0).

Baseline: ``import vllm`` in the same process (the start-up work vLLM does before calling us).
Bytecode: children may write ``__pycache__`` (as pip does at install) and one uncounted warm-up
child runs first, so import times are not source compilation. The warm-up also fills a fresh
table parse cache (:mod:`quantreg.table.cache`), as the first vLLM start after an install does;
the same measurement with the cache off (``QUANTREG_CACHE_DIR=off``: PyYAML imported, every
table parsed) runs interleaved with it and is reported in the notes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import ROOT, Metric, child_main, last_json_line, median, python_env

CHILD = Path(__file__).with_name("hook_child.py")

_IMPORT_LINE = re.compile(r"^import time:\s+(\d+)\s+\|\s+(\d+)\s+\|\s*(\S+)")
START, END = "QUANTREG-BENCH-HOOK-START", "QUANTREG-BENCH-HOOK-END"


def import_self_us(stderr: str) -> tuple[int, int, int, int]:
    """(self µs inside the markers, modules inside, self µs before the start marker, modules before)."""
    inside = before = 0
    count_inside = count_before = 0
    state = "before"
    for line in stderr.splitlines():
        if START in line:
            state = "inside"
            continue
        if END in line:
            state = "after"
            continue
        m = _IMPORT_LINE.match(line)
        if not m:
            continue
        if state == "inside":
            inside += int(m.group(1))
            count_inside += 1
        elif state == "before":
            before += int(m.group(1))
            count_before += 1
    return inside, count_inside, before, count_before


def one_child(env: dict[str, str], importtime: bool = False) -> dict[str, Any]:
    """One fresh process; with ``importtime``, also the self times of the imports (not for ``hook_ms``)."""
    with tempfile.TemporaryDirectory(prefix="quantreg-bench-hook-") as outside:
        proc = subprocess.run([sys.executable, *(["-X", "importtime"] if importtime else []), str(CHILD)],
                              cwd=outside, env=env, capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"hook_child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    result = last_json_line(proc.stdout)
    if not importtime:
        return result
    inside, count_inside, before, count_before = import_self_us(proc.stderr)
    result.update(register_import_us=inside, register_import_count=count_inside,
                  vllm_import_us=before, vllm_import_count=count_before)
    return result


def install_kind(quantreg_file: str) -> str:
    """``wheel`` when quantreg was imported from site-packages, else ``editable`` (a source tree)."""
    return "wheel" if "site-packages" in Path(quantreg_file).parts else "editable"


def run(quick: bool) -> list[Metric]:
    cache = tempfile.TemporaryDirectory(prefix="quantreg-bench-cache-")
    env = python_env(QUANTREG_CACHE_DIR=cache.name)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    # the checkout off the path: quantreg is imported as installed (wheel or editable), not from the source tree
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and Path(p).resolve() != ROOT.resolve())
    no_cache = {**env, "QUANTREG_CACHE_DIR": "off"}
    processes = 2 if quick else 12
    one_child(env)  # warm-up: writes bytecode and the table cache, warms the page cache; not counted
    runs: list[dict[str, Any]] = []
    runs_off: list[dict[str, Any]] = []
    timed: list[dict[str, Any]] = []
    for i in range(processes):  # A B A B: with the table cache, without it (once only in quick mode)
        runs.append(one_child(env))
        if not (quick and i):
            runs_off.append(one_child(no_cache))
        if i % 3 == 0:  # the import breakdown, in children of its own (every third round)
            timed.append(one_child(env, importtime=True))
    cache.cleanup()
    off_ms = [r["hook_s"] * 1e3 for r in runs_off]
    hook_ms = [r["hook_s"] * 1e3 for r in runs]
    vllm_ms = [r["import_vllm_s"] * 1e3 for r in runs]
    notes = [f"median over {processes} fresh processes" + (" (quick mode: fewer than the 10 the issue asks for; "
                                                          "each process imports vLLM, ~4-6 s)" if quick else ""),
             "time of entry_point.load() + register() after `import vllm`: imports, plugin discovery, default and "
             "plugin tables, post-import hook armed",
             "CPU time of the same window: {cpu:.1f} ms (wall time includes waiting for a core on a shared machine)",
             f"with the table parse cache off (QUANTREG_CACHE_DIR=off; also the very first start after an install), "
             f"interleaved: {median(off_ms):.1f} ms, {len(runs_off[0]['modules_added'])} modules (PyYAML imported)"]
    notes[-2] = notes[-2].format(cpu=median(r["hook_cpu_s"] * 1e3 for r in runs))
    hook = Metric(
        "hook_ms", median(hook_ms), "ms", baseline=median(vllm_ms), baseline_name="`import vllm` in the same process",
        ratio=median(hook_ms) / median(vllm_ms), ratio_means="quantreg / baseline (share of vLLM's own import)",
        goal="<= 50 ms", goal_met=median(hook_ms) <= 50, notes=notes,
        extra={"samples_ms": hook_ms, "cpu_ms": median(r["hook_cpu_s"] * 1e3 for r in runs),
               "cpu_samples_ms": [r["hook_cpu_s"] * 1e3 for r in runs], "rules": runs[0]["rules"],
               "tables": runs[0]["tables"],
               "methods": runs[0]["methods"], "problems": runs[0]["problems"],
               "cache_off_ms": median(off_ms), "cache_off_samples_ms": off_ms,
               "cache_off_modules": len(runs_off[0]["modules_added"]),
               "install": install_kind(runs[0]["quantreg_file"]), "quantreg_file": runs[0]["quantreg_file"],
               "table_names": runs[0]["table_names"],
               "full_scans": max(r["full_scans"] for r in runs)},
    )
    imported_methods = sorted({m for r in runs for m in r["method_modules_imported"]})
    reg_ms = [r["register_import_us"] / 1e3 for r in timed]
    vllm_import_ms = [r["vllm_import_us"] / 1e3 for r in timed]
    counts = [len(r["modules_added"]) for r in runs]
    register_import = Metric(
        "register_import_ms", median(reg_ms), "ms", baseline=median(vllm_import_ms),
        baseline_name="self time of the imports done by `import vllm` (same report)",
        ratio=median(reg_ms) / median(vllm_import_ms), ratio_means="quantreg / baseline",
        goal="no plugin method module imported", goal_met=not imported_methods,
        notes=[f"{counts[0]} modules added to sys.modules by register() (quantreg, pluggy, the plugin's hook "
               "module; PyYAML only when a table is not in the parse cache); sum of their -X importtime self times "
               f"(median of {len(timed)} children run with -X importtime, apart from those timing hook_ms)",
               "method modules of the registered methods: " + ", ".join(runs[0]["method_modules"])
               + (f"; IMPORTED: {', '.join(imported_methods)}" if imported_methods else "; none imported")],
        extra={"count": counts[0], "counts": counts, "modules": runs[0]["modules_added"],
               "vllm_import_module_count": timed[0]["vllm_import_count"], "samples_ms": reg_ms,
               "method_modules_imported": imported_methods},
    )
    return [hook, register_import]


def main() -> None:
    os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child_main(run, __doc__)


if __name__ == "__main__":
    main()
