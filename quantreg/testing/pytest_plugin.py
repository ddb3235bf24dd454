"""pytest plugin: the conformance suite as test items, and fixtures that build real vLLM MoE layers.

Loaded through the ``pytest11`` entry point (or ``-p quantreg.testing.pytest_plugin``). A plugin
author's CI needs one test::

    import pytest

    @pytest.mark.quantreg_method("my_method")
    def test_conformance(quantreg_check):
        quantreg_check()

which becomes one item per check (``test_conformance[my_method-forward-bias]``, ...): a passing
check passes, a failing one fails with the check's message, a check that needs a device this
machine lacks is skipped with the reason. The suite runs once per method and session; the items
only report their row. ``--quantreg-method NAME`` (repeatable) or the ini option
``quantreg_methods`` name the methods instead of the marker; ``--quantreg-device`` / ini
``quantreg_device`` pick the device (default: guessed without importing vLLM).

Fixtures: ``quantreg_registry`` (session; override it to check against a hand-built
:class:`~quantreg.Registry`), ``quantreg_device``, ``moe_harness`` (session: a
:class:`~quantreg.testing.harness.VllmMoeHarness` for a plugin's own layer tests), and
``gpt_oss_mxfp4_experts`` (a factory of valid random experts, :mod:`quantreg.models.gpt_oss_moe`).

pytest loads this module in every session of an environment where quantreg is installed, so it
imports neither torch nor vLLM until a fixture that needs them is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

from ..registry import Registry
from .api import run_checks
from .checks import CHECK_IDS
from .report import CheckResult, Report, Status

if TYPE_CHECKING:
    from ..models.gpt_oss_moe import GptOssMxfp4Experts
    from .harness import VllmMoeHarness

MARKER = "quantreg_method"
FIXTURE = "quantreg_check"
_REPORTS = pytest.StashKey[dict[tuple[Any, ...], Report]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("quantreg", "quantreg MoE method conformance (quantreg.testing)")
    group.addoption("--quantreg-method", action="append", default=[], metavar="NAME", dest="quantreg_methods",
                    help="run the quantreg_check conformance items on this registered method (repeatable; "
                         "overrides @pytest.mark.quantreg_method)")
    group.addoption("--quantreg-device", default=None, metavar="DEVICE", dest="quantreg_device",
                    help="device to check methods for (default: ini quantreg_device, else guessed: hpu, cuda, cpu)")
    parser.addini("quantreg_methods", type="linelist", default=[],
                  help="methods quantreg_check runs on when neither a marker nor --quantreg-method names one")
    parser.addini("quantreg_device", default="", help="device quantreg_check checks methods for")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(*names, tolerance=None, option_sets=()): registered quantreg methods the {FIXTURE} fixture "
        "runs the conformance suite on (tolerance overrides the method's quantreg_tolerance; option_sets are "
        "extra option dicts to build it with)")
    config.stash[_REPORTS] = {}


@dataclass(frozen=True)
class _Param:
    method: str
    check: str
    tolerance: float | None = None
    option_sets: tuple[Mapping[str, Any], ...] = field(default=())


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize tests using ``quantreg_check`` over (method, check)."""
    if FIXTURE not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker(MARKER)
    methods: list[str] = list(metafunc.config.getoption("quantreg_methods") or [])
    if not methods and marker is not None:
        methods = [str(a) for a in marker.args]
    if not methods:
        methods = [str(m) for m in metafunc.config.getini("quantreg_methods")]
    kwargs = dict(marker.kwargs) if marker is not None else {}
    tolerance = kwargs.get("tolerance")
    option_sets = tuple(kwargs.get("option_sets", ()))
    if not methods:
        params = [_Param("", "")]
        ids = ["no-method-named"]
    else:
        params = [_Param(m, c, tolerance, option_sets) for m in methods for c in CHECK_IDS]
        ids = [f"{p.method}-{p.check}" for p in params]
    metafunc.parametrize(FIXTURE, params, ids=ids, indirect=True)


class ConformanceCheck:
    """What ``quantreg_check`` gives a test: call it to assert the check (PASS returns its result).

    A test that never calls it is checked after its body anyway, so an empty test body cannot
    pass vacuously.
    """

    def __init__(self, param: _Param, report: Callable[[], Report]) -> None:
        self.method = param.method
        self.check = param.check
        self._report = report
        self.called = False

    def result(self) -> CheckResult:
        return self._report().result(self.check)

    def __call__(self) -> CheckResult:
        self.called = True
        result = self.result()
        if result.status is Status.FAIL:
            pytest.fail(f"quantreg conformance: {self.method} {self.check} FAILED: {result.detail}", pytrace=False)
        if result.status is Status.SKIPPED:
            pytest.skip(f"{self.method} {self.check}: {result.detail}")
        return result


@pytest.fixture(scope="session")
def quantreg_registry() -> Registry:
    """The registry methods are looked up in (and whose rules' options are tried): the installed one."""
    return Registry.build()


@pytest.fixture(scope="session")
def quantreg_device(pytestconfig: pytest.Config) -> str:
    from ..host import guess_device

    chosen = pytestconfig.getoption("quantreg_device") or pytestconfig.getini("quantreg_device")
    return str(chosen) if chosen else guess_device()


@pytest.fixture
def quantreg_check(request: pytest.FixtureRequest, quantreg_registry: Registry,
                   quantreg_device: str) -> ConformanceCheck:
    param = getattr(request, "param", None)
    if not isinstance(param, _Param) or not param.method:
        pytest.fail(f"{FIXTURE} needs a method: mark the test @pytest.mark.{MARKER}('name'), pass "
                    "--quantreg-method NAME, or set the ini option quantreg_methods", pytrace=False)
    reports = request.config.stash[_REPORTS]

    def report() -> Report:
        key = (param.method, quantreg_device, id(quantreg_registry), param.tolerance,
               repr(param.option_sets))
        if key not in reports:
            reports[key] = run_checks(param.method, registry=quantreg_registry, device=quantreg_device,
                                      tolerance=param.tolerance, option_sets=param.option_sets)
        return reports[key]

    return ConformanceCheck(param, report)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """After a test using ``quantreg_check`` that did not call it, call it (fail/skip as the check says)."""
    result = yield
    funcargs = getattr(item, "funcargs", {})
    check = funcargs.get(FIXTURE) if isinstance(funcargs, dict) else None
    if isinstance(check, ConformanceCheck) and not check.called:
        check()
    return result


@pytest.fixture(scope="session")
def moe_harness(quantreg_device: str) -> Iterator[VllmMoeHarness]:
    """Real vLLM MoE layers under a tiny GPT-OSS config: ``moe_harness.ready(factory, experts, top_k=2)``."""
    from .harness import VllmMoeHarness

    with VllmMoeHarness(quantreg_device) as harness:
        yield harness


@pytest.fixture
def gpt_oss_mxfp4_experts() -> Callable[..., GptOssMxfp4Experts]:
    """``make(num_experts=8, hidden=64, intermediate=96, bias=True, seed=0)``: valid random MXFP4 experts."""
    from ..models.gpt_oss_moe import random_gpt_oss_mxfp4_experts

    def make(num_experts: int = 8, hidden: int = 64, intermediate: int = 96, *, bias: bool = True,
             seed: int = 0) -> GptOssMxfp4Experts:
        return random_gpt_oss_mxfp4_experts(num_experts, hidden, intermediate, bias=bias, seed=seed)

    return make


__all__: Sequence[str] = ("ConformanceCheck", "gpt_oss_mxfp4_experts", "moe_harness", "quantreg_check",
                          "quantreg_device", "quantreg_registry")
