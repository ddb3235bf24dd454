"""One fresh process for :mod:`bench.hook_bench`: import vLLM, then run quantreg's entry point.

Run with ``python -X importtime -m bench.hook_child``: the markers on stderr bracket the imports
``register()`` causes, so the parent can add up their self times. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    start = time.perf_counter()
    import vllm  # noqa: F401 - the point: vLLM is already imported when its plugin loader calls us

    import_vllm_s = time.perf_counter() - start
    from importlib import metadata

    (entry_point,) = [ep for ep in metadata.entry_points(group="vllm.general_plugins") if ep.name == "quantreg"]
    before = set(sys.modules)
    print("QUANTREG-BENCH-HOOK-START", file=sys.stderr, flush=True)
    t0, c0 = time.perf_counter(), time.thread_time()
    register = entry_point.load()  # what vllm.plugins.load_general_plugins does for each plugin:
    register()  # load the entry point, call it
    hook_s, hook_cpu_s = time.perf_counter() - t0, time.thread_time() - c0
    print("QUANTREG-BENCH-HOOK-END", file=sys.stderr, flush=True)
    added = sorted(set(sys.modules) - before)

    from quantreg.registry import get_registry

    registry = get_registry()
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
    }))


if __name__ == "__main__":
    main()
