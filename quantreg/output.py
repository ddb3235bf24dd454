"""How every ``quantreg`` command answers: ``--json`` or lines, plugin output kept off stdout, the start-up verdict.

Why a module of its own: the command line (:mod:`quantreg.cli`) and ``doctor``
(:mod:`quantreg.doctor`) answer the same way, and ``doctor`` may not import the module that
wires it up (that would be an import circle).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from .decision import Decision
from .envelope import envelope, left_out_lines
from .problems import problem_json
from .registry import Registry


def emit(args: argparse.Namespace, data: Any, text: str) -> None:
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=False, default=str))
    else:
        print(text)


def warn_faults(registry: Registry) -> None:
    for fault in registry.faults:
        print(f"warning: {fault}", file=sys.stderr)


@contextlib.contextmanager
def plugin_output_to_stderr() -> Iterator[None]:
    """While plugin code (imports, hooks, probes) runs, its prints go to stderr: stdout is the answer."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def registry_for(args: argparse.Namespace) -> Registry:
    with plugin_output_to_stderr():
        return Registry.build(config=args.config)


def respond(args: argparse.Namespace, registry: Registry, data: dict[str, Any], lines: list[str],
            decision: Decision | None = None, left_out_shown: bool = False, problems: Sequence[object] = ()) -> int:
    """Print ``data`` (with the envelope) or ``lines`` (with left-out files), then the start-up verdict.

    Exit 1 when strict mode is in force and vLLM would refuse to start, 0 otherwise: the CLI
    must not answer "fine" where vLLM with the same environment stops.
    """
    wrapped = {**data, **envelope(None, registry, args.config, decision)}
    wrapped["problems"] += [problem_json(p) for p in problems]  # the command's own (doctor --decisions...)
    refusal = wrapped["vllm_would_refuse"]
    if wrapped["left_out"] and not args.json and not left_out_shown:
        lines = [*lines, "left out (every rule of these files is ignored):", *left_out_lines(wrapped["left_out"])]
    emit(args, wrapped, "\n".join(lines))
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 1
    return 0
