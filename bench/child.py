"""Run one or more benchmark modules in this (fresh) process: ``python -m bench.child MOD [MOD...]``.

Why a child per group: each group gets a clean interpreter (no torch in the registry numbers, no
gigabytes left over from the dequantisation run), and modules that both need vLLM imported share
one import (~4-6 s) instead of paying it twice.
"""

from __future__ import annotations

import argparse
import importlib

from bench.common import Metric, write_child_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("modules", nargs="+", help="bench.<module> names, e.g. decode_bench pwal_bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    metrics: list[Metric] = []
    for name in args.modules:
        module = importlib.import_module(f"bench.{name}")
        metrics += module.run(args.quick)
    write_child_result(args.out, metrics)


if __name__ == "__main__":
    main()
