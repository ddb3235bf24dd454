"""What one conformance run knows, and how a check's body becomes its row.

A check is a function of a :class:`Context`: it returns normally to pass (with the detail it
set through :meth:`Context.passed`), raises :func:`fail` or :func:`skip` to end early with that
outcome, and any other exception is a FAIL naming it. What a check *needs* before it can run
(:class:`Need`) is asked of the context, which says why not in the words the row will show, so
no check repeats another's preconditions.

This module imports neither torch nor vLLM at import time (:meth:`Context.unmet` imports them
when a check needs them).
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from ..error_measure import DEFAULT_TOLERANCE
from ..methods import Availability, Method
from ..problems import describe
from ..registry import Registry
from .report import CheckResult, Status
from .shapes import DEFAULT_SHAPE, MoeShape

if TYPE_CHECKING:
    from .harness import VllmMoeHarness

DEFAULT_FORMAT = "gpt_oss_mxfp4"
SUPPORTED_FORMATS = (DEFAULT_FORMAT,)


class Need(IntEnum):
    """What a check needs, each level including the ones before it (the first unmet one is the
    reason it is skipped)."""

    NOTHING = 0
    """The :class:`Method`'s declarations only: runs without torch or vLLM."""
    VLLM = 1
    """torch and vLLM importable here."""
    CLASS = 2
    """The method's class, imported and a ``FusedMoEMethodBase`` (the ``subclass`` check provides it)."""
    FORMAT = 3
    """A weight format the kit can feed (:data:`SUPPORTED_FORMATS`)."""
    DEVICE = 4
    """The method runs on the device checked for (``Method.availability``)."""


CheckFunction = Callable[["Context"], None]


@dataclass(frozen=True)
class CheckSpec:
    """One entry of the suite (:data:`quantreg.testing.checks.CHECKS`)."""

    id: str
    title: str
    needs: Need
    function: CheckFunction
    provides: Need | None = None
    """The need this check establishes: it also runs, unreported, when a wanted check needs it."""

    @property
    def needs_device(self) -> bool:
        return self.needs >= Need.DEVICE


class Outcome(Exception):
    """Ends a check early with its result (raised by :func:`fail` / :func:`skip`)."""

    def __init__(self, status: Status, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def fail(detail: str) -> Outcome:
    return Outcome(Status.FAIL, detail)


def skip(detail: str) -> Outcome:
    return Outcome(Status.SKIPPED, detail)


class Context:
    """One conformance run: the state shared by the checks of one method on one device."""

    def __init__(self, method: Method, registry: Registry | None, device: str, tolerance: float | None,
                 option_sets: Sequence[Mapping[str, Any]], only: set[str], harness: VllmMoeHarness | None,
                 probe_budget: float, shape: MoeShape = DEFAULT_SHAPE) -> None:
        #: Called with each check's id before it runs (``quantreg check-method``'s progress lines).
        self.progress: Callable[[str], None] | None = None
        self.method = method
        self.shape = shape
        """The layer shape the weights and numerical checks build (:mod:`~quantreg.testing.shapes`)."""
        self.registry = registry
        self.device = device
        self.tolerance_override = tolerance
        self.extra_option_sets = [dict(o) for o in option_sets]
        self.only = only
        self.probe_budget = probe_budget
        self.results: dict[str, CheckResult] = {}
        self.availability: Availability = method.availability(device)
        self.cls: type[Any] | None = None
        """Set by the ``subclass`` check (:attr:`Need.CLASS`)."""
        self.blocked = "its class was not checked"
        """Why :attr:`cls` is missing, for the rows of the checks that need it."""
        self.fused_moe_base: type[Any] | None = None
        self._stack_missing: str | None = None
        self._harness = harness
        self._own_harness = False
        self._pass_detail = ""

    # -- reporting --------------------------------------------------------------------------------
    def record(self, spec: CheckSpec, status: Status, detail: str) -> None:
        if spec.id in self.only:
            self.results[spec.id] = CheckResult(spec.id, spec.title, status, detail, spec.needs_device)

    @contextlib.contextmanager
    def check(self, spec: CheckSpec) -> Iterator[None]:
        """Run a check's body: a normal return is PASS with the detail set by :meth:`passed`,
        :class:`Outcome` is FAIL/SKIPPED, any other exception is a FAIL that names it."""
        self._pass_detail = ""
        try:
            yield
        except Outcome as outcome:
            self.record(spec, outcome.status, outcome.detail)
        except Exception as exc:
            self.record(spec, Status.FAIL, f"raised {describe(exc, located=True)}")
        else:
            self.record(spec, Status.PASS, self._pass_detail)

    def passed(self, detail: str) -> None:
        self._pass_detail = detail

    def refused_here(self, exc: Exception) -> Outcome | None:
        """A SKIPPED outcome when building raised where the method is not available, else ``None``.

        A method that cannot run here must refuse in its constructor (the ``first-forward``
        check, issue 46): plugin #2 without its loadable library, say. Where
        ``Method.availability`` already says no, that refusal is the method doing its job, not a
        defect of the device-independent checks that build it; where it says yes, the build
        failing is the check's FAIL.
        """
        if self.availability.ok:
            return None
        return skip(f"not available on {self.device} ({self.availability.reason}), and its constructor refuses "
                    f"to build here: {describe(exc)}; checked where it runs")

    # -- what the checks need ---------------------------------------------------------------------
    def unmet(self, need: Need) -> str | None:
        """Why a check needing ``need`` cannot run here (its SKIPPED detail), or None if it can."""
        if need >= Need.VLLM and (missing := self._import_stack()):
            return missing
        if need >= Need.CLASS and self.cls is None:
            return f"not checked: {self.blocked}"
        if need >= Need.FORMAT and self.quant_format not in SUPPORTED_FORMATS:
            return (f"the kit has no harness for format '{self.quant_format}' (quantreg_format); "
                    f"it checks: {', '.join(SUPPORTED_FORMATS)}")
        if need >= Need.DEVICE and not self.availability.ok:
            return f"needs a device where '{self.method.name}' runs; on {self.device}: {self.availability.reason}"
        return None

    def _import_stack(self) -> str | None:
        if self.fused_moe_base is None and self._stack_missing is None:
            try:
                importlib.import_module("torch")
                fused_moe = importlib.import_module("vllm.model_executor.layers.fused_moe")
                self.fused_moe_base = fused_moe.FusedMoEMethodBase
            except Exception as exc:
                self._stack_missing = f"vLLM is not importable here ({describe(exc, located=True)})"
        return self._stack_missing

    # -- what the class declares ------------------------------------------------------------------
    @property
    def quant_format(self) -> str:
        """The class's ``quantreg_format`` (the default before the class is loaded)."""
        return str(getattr(self.cls, "quantreg_format", DEFAULT_FORMAT))

    def declared_tolerance(self) -> tuple[float, str | None]:
        """(tolerance the numerical checks use, what is wrong with the declared one or None).

        Without the class (not loaded, or it could not be) nothing was declared, so the default,
        which is also what the report shows then; ``tolerance=`` applies to a loaded class only."""
        if self.cls is None:
            return DEFAULT_TOLERANCE, None
        tol = self.tolerance_override if self.tolerance_override is not None else getattr(
            self.cls, "quantreg_tolerance", DEFAULT_TOLERANCE)
        if not isinstance(tol, (int, float)) or isinstance(tol, bool) or not math.isfinite(tol) or tol <= 0:
            return DEFAULT_TOLERANCE, (f"quantreg_tolerance = {tol!r}; declare a positive number (the max |out - "
                                       "ref| / max |ref| the method guarantees)")
        return float(tol), None

    @property
    def tolerance(self) -> float:
        return self.declared_tolerance()[0]

    # -- layers -----------------------------------------------------------------------------------
    @property
    def harness(self) -> VllmMoeHarness:
        """Layers live on the device when the method runs there; otherwise the device-independent
        checks (construction, ``create_weights``, loading) use CPU tensors."""
        wanted = self.device if self.availability.ok else "cpu"
        if self._harness is None or self._harness.device != wanted:
            from .harness import VllmMoeHarness

            self.close()
            self._harness = VllmMoeHarness(wanted)
            self._own_harness = True
        return self._harness

    def close(self) -> None:
        if self._own_harness and self._harness is not None:
            self._harness.close()
            self._harness, self._own_harness = None, False

    def factory(self, options: Mapping[str, Any] | None = None) -> Any:
        from .harness import method_factory

        assert self.cls is not None
        return method_factory(self.cls, options)
