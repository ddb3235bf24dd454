"""What this host and environment offer the tests: the host's kind of CPU (AMX or AVX2-only, read
once, and how a test gets either branch on any host), the skip policy (a skip stands only for a
top-level package that is absent; ``QUANTREG_FULL_ENV=1`` fails any skip for an absent stack), and
what a table choosing plugin #1's reference gets here.

Every name here is also importable from core_support.py (re-exported); tests/conftest.py registers
``host_kind`` and :class:`SkipPolicy` from there.
"""

from __future__ import annotations

import os
import re
from collections.abc import Generator, Mapping
from typing import Any

import pytest

from quantreg.installed import module_available

# -- the host's kind of CPU -------------------------------------------------------------------

#: The two branches of truth a CPU-dependent expectation has: vLLM's own CPU MXFP4 kernel runs (AMX) or not.
HOST_KINDS = ("amx", "avx2")


class HostKind:
    """This host's CPU facts, read once (``quantreg.host.host_facts`` for quantreg's beliefs, torch's
    AMX check for what vLLM will find), and how a test gets either kind's branch on it.

    * :meth:`believe` -- the environment that makes quantreg believe ``kind`` (any host: only beliefs);
    * :meth:`vllm_env` -- the environment a vLLM child needs to behave like ``kind``: nothing on a
      host of that kind, AMX hidden (``quantreg.testing.host_kind.without_amx_env``) for ``avx2`` on
      an AMX host, and a skip naming the hardware for ``amx`` on a host without it;
    * :meth:`kernel_runs` -- what vLLM's own MXFP4 kernel does under ``kind`` (``amx``: runs).
    """

    def __init__(self) -> None:
        from quantreg.host import host_facts
        from quantreg.testing.host_kind import real_amx

        self.facts = host_facts()
        self.real_amx = real_amx()

    @property
    def kind(self) -> str:
        """This host's own branch: ``amx`` when vLLM's kernel really runs here, else ``avx2``."""
        return "amx" if self.real_amx else "avx2"

    def believe(self, kind: str) -> dict[str, str]:
        from quantreg.host import simulate

        return simulate(kind)

    def vllm_env(self, kind: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
        from quantreg.testing.host_kind import needs_real_amx, without_amx_env

        if kind == "amx":
            if not self.real_amx:
                pytest.skip(needs_real_amx("the branch where vLLM's own CPU MXFP4 kernel runs"))
            return dict(base or {})
        if kind != "avx2":
            raise ValueError(f"unknown host kind {kind!r} (expected one of {HOST_KINDS})")
        if not self.real_amx:
            return dict(base or {})
        return {**dict(base or {}), **without_amx_env({**os.environ, **dict(base or {})})}

    @staticmethod
    def kernel_runs(kind: str) -> bool:
        return kind == "amx"


_HOST_KIND: list[HostKind] = []


@pytest.fixture(scope="session")
def host_kind() -> HostKind:
    """The session's :class:`HostKind` (facts read once)."""
    if not _HOST_KIND:
        _HOST_KIND.append(HostKind())
    return _HOST_KIND[0]


# -- skips only for what is absent (issue 31.4; registered by tests/conftest.py) ----------------


#: Is a module importable? quantreg's own reading (``find_spec``: nothing is imported).
importable = module_available


#: Set (to ``1``) where every optional stack is installed (``.ci/run``): a skip for an absent one fails.
FULL_ENV = "QUANTREG_FULL_ENV"
_NOT_IMPORTED = re.compile(r"(?:could not import|No module named) '([A-Za-z0-9_.]+)'")
_ABSENT = re.compile(r"not installed|could not import|No module named", re.IGNORECASE)


def skip_verdict(reason: str, env: Any = os.environ) -> str | None:
    """Why a skip with ``reason`` must fail instead, or ``None`` when the skip stands.

    A skip naming a module that cannot be imported stands only when that module's top-level
    package is absent; in the full environment (:data:`FULL_ENV`) no skip for an absent stack stands.
    """
    named = _NOT_IMPORTED.search(reason)
    if named is not None and "." in named.group(1):
        top = named.group(1).split(".")[0]
        if importable(top):
            return (f"{named.group(1)} cannot be imported although {top} is installed: a moved or missing "
                    f"submodule is breakage, not absence (skip reason was: {reason})")
    if env.get(FULL_ENV) == "1" and _ABSENT.search(reason):
        return f"{FULL_ENV}=1 says every optional stack is installed here, yet a test skipped: {reason}"
    return None


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


class SkipPolicy:
    """:func:`skip_verdict` over every skip of the run, tests/ and plugins/*/tests alike.

    Registered as a plugin (not a conftest hook) so it also sees the plugins' tests.
    """

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
        report: pytest.TestReport = yield
        if report.skipped and not hasattr(report, "wasxfail"):
            verdict = skip_verdict(_skip_reason(report))
            if verdict is not None:
                report.outcome = "failed"
                report.longrepr = verdict
        return report

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector) -> Generator[None, Any, Any]:
        report: pytest.CollectReport = yield
        if report.skipped:
            verdict = skip_verdict(_skip_reason(report))
            if verdict is not None:
                report.outcome = "failed"
                report.longrepr = verdict
        return report


# -- what a table choosing plugin #1's reference gets here (issue 31.4) ------------------------

#: ``mxfp4_reference`` declares ``requires=("torch", "vllm")``: where both are installed a rule naming it
#: gets it; where either is absent (core + plugin #1 without torch) its chain falls through to vLLM's own
#: method, which is what the registry chooses and what tests must then expect.
REFERENCE_RUNS = importable("torch") and importable("vllm")
REFERENCE = "mxfp4_reference" if REFERENCE_RUNS else "vllm"
