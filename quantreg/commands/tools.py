"""The commands that hand off to the module doing the work: ``doctor``, ``plan``, ``tiny-model``, ``tune``,
``schema``, ``demo``, ``new-plugin``, ``check-method``.

Each imports its module only when it runs: torch, vLLM and the kit are loaded by the commands that need
them, never by ``quantreg --help`` or a table command.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..envelope import envelope
from ..output import registry_for
from ..table import cache as tablecache
from ..table.schema import table_schema
from .tables import device_warnings


def cmd_doctor(args: argparse.Namespace) -> int:
    from ..doctor import doctor

    with tablecache.bypass():  # doctor reports what the files say, not what the cache remembers
        return doctor(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from ..plan import plan_command

    return plan_command(args.model_dir, args.device, args.config, args.json,
                        use_vllm=False if args.no_vllm else None,
                        envelope=lambda registry, problems: envelope(problems, registry, args.config))


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from ..tiny.command import tiny_model_command  # imports torch (the checkpoint writer)

    return tiny_model_command(args.directory, bf16=args.bf16, as_json=args.json, force=args.force, shape=args.shape,
                              layers=args.layers, seed=args.seed, planted=args.planted)


def cmd_tune(args: argparse.Namespace) -> int:
    if args.layers is not None or args.allow_lossy:  # dense layer kinds (issue 30): quantreg/tune/dense.py
        from ..tune.dense import tune_layers

        return tune_layers(args.model_dir, args.layers or "experts", device=args.device, out=args.out,
                           as_json=args.json, budget=args.budget, synthetic=args.synthetic,
                           allow_lossy=args.allow_lossy, config=args.config, tokens=args.tokens)
    from ..tune.command import tune_command  # measure.py imports torch and vLLM only once measuring starts

    return tune_command(args.model_dir, device=args.device, out=args.out, as_json=args.json, budget=args.budget,
                        synthetic=args.synthetic, config=args.config, tokens=args.tokens)


def cmd_schema(args: argparse.Namespace) -> int:
    """The schema itself; with ``--json`` inside the envelope like every other answer (``schema`` key)."""
    print(json.dumps({"schema": table_schema(), **envelope()} if args.json else table_schema(), indent=2))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ..demo.command import run_demo

    return run_demo(keep=args.keep, as_json=args.json)


def cmd_new_plugin(args: argparse.Namespace) -> int:
    from ..newplugin import new_plugin_command

    return new_plugin_command(args.name, args.directory, as_json=args.json)


def cmd_check_method(args: argparse.Namespace) -> int:
    from ..testing import check_method_command  # imports torch and vLLM only when the checks run

    for warning in device_warnings(registry_for(args), [args.device]):
        print(f"warning: {warning}", file=sys.stderr)

    return check_method_command(args.name, device=args.device, config=args.config, as_json=args.json,
                                envelope=lambda registry: envelope(None, registry, args.config), shape=args.shape)
