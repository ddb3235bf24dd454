"""One fresh process for :mod:`bench.hook_bench`: import vLLM, then run quantreg's entry point.

Run by path (``python [-X importtime] bench/hook_child.py``) from a directory outside the checkout:
``quantreg`` and the plugins are then imported as installed (a wheel's copy in site-packages, or an
editable install's source tree), never from a checkout that happens to be the current directory.
The markers on stderr bracket the imports ``register()`` causes, so the parent can add up their
self times. Prints one JSON line, with where ``quantreg`` came from, the tables' names in the
fingerprint and the number of full metadata scans (``packages_distributions``) register() caused.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping


def main() -> None:
    start = time.perf_counter()
    import vllm  # noqa: F401 - the point: vLLM is already imported when its plugin loader calls us

    import_vllm_s = time.perf_counter() - start
    from importlib import metadata

    scans: list[int] = []
    full_scan = metadata.packages_distributions

    def counted_scan() -> Mapping[str, list[str]]:
        scans.append(1)
        return full_scan()

    metadata.packages_distributions = counted_scan
    (entry_point,) = [ep for ep in metadata.entry_points(group="vllm.general_plugins") if ep.name == "quantreg"]
    before = set(sys.modules)
    print("QUANTREG-BENCH-HOOK-START", file=sys.stderr, flush=True)
    t0, c0 = time.perf_counter(), time.thread_time()
    register = entry_point.load()  # what vllm.plugins.load_general_plugins does for each plugin:
    register()  # load the entry point, call it
    hook_s, hook_cpu_s = time.perf_counter() - t0, time.thread_time() - c0
    print("QUANTREG-BENCH-HOOK-END", file=sys.stderr, flush=True)
    added = sorted(set(sys.modules) - before)

    import quantreg
    from quantreg.registry import get_registry
    from quantreg.table.identity import table_names

    registry = get_registry()
    names = table_names([(t.path, str(t.tier)) for t in registry.tables])
    method_modules = sorted({m.target.partition(":")[0] for m in registry.methods.values()
                             if m.plugin != "quantreg.builtin"})
    print(json.dumps({
        "import_vllm_s": import_vllm_s,
        "hook_s": hook_s,
        "hook_cpu_s": hook_cpu_s,
        "modules_added": added,
        "method_modules": method_modules,
        "method_modules_imported": [m for m in method_modules if m in sys.modules],
        "rules": len(registry.index.rules),
        "tables": len(registry.tables),
        "methods": sorted(registry.methods),
        "problems": [str(p) for p in registry.problems],
        "quantreg_file": quantreg.__file__,
        "table_names": sorted(names.values()),
        "full_scans": len(scans),
    }))


if __name__ == "__main__":
    main()
