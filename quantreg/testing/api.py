"""The kit's entry points: :func:`run_checks` from Python, :func:`check_method_command` for the CLI.

Both find the method, run :func:`quantreg.testing.checks.run_suite` on it under the
:mod:`~quantreg.testing.env` settings, and hand back a :class:`Report`; neither imports torch or
vLLM before the checks need them.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..keys import EXPERTS
from ..methods import VLLM_METHOD, Method
from ..problems import did_you_mean, printable
from ..registry import Registry
from . import checks
from .context import Context
from .env import one_thread, quiet_vllm
from .report import CheckResult, Report, Status
from .shapes import DEFAULT_SHAPE, MoeShape, parse_shape

if TYPE_CHECKING:
    from .harness import VllmMoeHarness


def resolve_method(method: str | Method, registry: Registry | None) -> tuple[Method | None, Registry | None, str]:
    """The :class:`Method` to check, the registry its rules come from, and why not if it is missing."""
    if isinstance(method, Method):
        return method, registry, ""
    registry = registry if registry is not None else Registry.build()
    found = registry.methods.get(method)
    if found is not None:
        return found, registry, ""
    names = sorted(registry.methods)
    faults = [str(f) for f in registry.failures]
    why = (f"no method '{method}' is registered{did_you_mean(method, names)} (registered: {', '.join(names)})"
           + (f"; plugin faults: {'; '.join(faults)}" if faults else ""))
    return None, registry, why


def run_checks(
    method: str | Method,
    *,
    registry: Registry | None = None,
    device: str = "cpu",
    tolerance: float | None = None,
    option_sets: Sequence[Mapping[str, Any]] = (),
    only: Iterable[str] | None = None,
    harness: VllmMoeHarness | None = None,
    shape: MoeShape | str = DEFAULT_SHAPE,
    progress: Callable[[str], None] | None = None,
) -> Report:
    """Run the conformance suite on a registered method (by name) or on a :class:`Method`.

    ``registry`` supplies the method and the rules whose options are tried (built from the
    environment when a name is given without one). ``tolerance`` overrides the class's
    ``quantreg_tolerance``; ``option_sets`` are tried in addition to the rules' options; ``only``
    restricts the run to some of :data:`~quantreg.testing.checks.CHECK_IDS`; ``harness`` reuses a
    :class:`~quantreg.testing.harness.VllmMoeHarness` (one is made and removed otherwise).
    ``shape`` is the layer the weights and numerical checks build: a
    :class:`~quantreg.testing.shapes.MoeShape`, or ``"20b"``/``"120b"``/``"E,H,I"``
    (:func:`~quantreg.testing.shapes.parse_shape`); real shapes run a smaller grid of forwards.
    """
    if isinstance(shape, str):
        shape = parse_shape(shape)
    ids = checks.CHECK_IDS
    selected = set(ids if only is None else only)
    unknown = selected - set(ids)
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(sorted(unknown))}; checks are: {', '.join(ids)}")
    name = method if isinstance(method, str) else method.name
    found, registry, why = resolve_method(method, registry)
    report = Report(method=name, device=device, shape=shape.label())
    if found is None or found.name == VLLM_METHOD:
        status, rest = (Status.FAIL, "not registered") if found is None else (Status.SKIPPED, "nothing to check")
        why = why or f"'{VLLM_METHOD}' stands for vLLM's own method choice; there is no plugin class to check"
        report.availability = why
        first, *others = checks.CHECKS  # the first check is the registration itself
        report.results.append(CheckResult(first.id, first.title, status, why))
        report.results += [CheckResult(c.id, c.title, Status.SKIPPED, rest, c.needs_device)
                           for c in others if c.id in selected]
        return report
    report.numerics = found.numerics
    if EXPERTS not in found.layers:  # a dense method (issue 30): real linear layers and lm_heads
        from .dense import run_dense_suite

        report.target, report.plugin = found.target, found.plugin
        with one_thread():
            run_dense_suite(found, report, device, tolerance, shape)
        _keep_compiled(found, report)
        return report
    ctx = Context(found, registry, device, tolerance, option_sets, selected, harness, checks.PROBE_BUDGET_S, shape)
    ctx.progress = progress
    try:
        with one_thread():
            checks.run_suite(ctx)
    finally:
        ctx.close()
    report.target, report.plugin = found.target, found.plugin
    report.available, report.availability = ctx.availability.ok, ctx.availability.reason
    report.tolerance, report.quant_format = ctx.tolerance, ctx.quant_format
    report.results = [ctx.results[c] for c in ids if c in ctx.results]
    _keep_compiled(found, report)
    return report


def _keep_compiled(method: Method, report: Report) -> None:
    """The ``compiled`` check's PASS or FAIL, kept for ``quantreg doctor`` (:mod:`.compiled_record`)."""
    from .compiled_record import record

    for result in report.results:
        if result.check == "compiled" and result.status in (Status.PASS, Status.FAIL):
            record(method, result.status.value, result.detail)


def check_method_command(name: str, *, device: str | None = None, config: Sequence[str] = (),
                         as_json: bool = False,
                         envelope: Callable[[Registry], Mapping[str, Any]] | None = None,
                         shape: str = "small") -> int:
    """``quantreg check-method``: run the suite, print the table (or JSON), 0 if nothing failed.

    The run happens under :func:`~quantreg.testing.env.quiet_vllm`, so that stdout carries the
    table (or valid JSON) only, and vLLM's INFO chatter is off unless ``VLLM_LOGGING_LEVEL`` is set.
    """
    from ..host import guess_device

    registry = Registry.build(config=config)
    for fault in [*registry.problems, *registry.failures]:
        print(f"warning: {fault}", file=sys.stderr)
    started = time.monotonic()

    def progress(check: str) -> None:  # stderr, so stdout stays the table (or the JSON)
        print(f"check-method [{time.monotonic() - started:.0f}s]: {printable(check)} (shape {printable(shape)}) ...",
              file=sys.stderr,
              flush=True)

    with quiet_vllm():
        report = run_checks(name, registry=registry, device=device or guess_device(), shape=shape,
                            progress=None if as_json else progress)
    if as_json and envelope is not None:  # the CLI's envelope: problems as objects, left_out, vllm_would_refuse
        print(json.dumps({**report.to_json(), **envelope(registry)}, indent=2, default=str))
    else:
        print(report.for_terminal(as_json=as_json))
    return 0 if report.ok else 1
