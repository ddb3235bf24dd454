"""Fixtures for the core tests live in core_support.py (a unique module name, so test files can
import its helpers without clashing with tests/e2e/conftest.py or the plugin's conftest).

Also the suite's phase clock: at the end of a run pytest prints how the wall time splits into
the unit tests and the real-vLLM tests (marker ``vllm``: tests/e2e, the plugin's layer tests),
because CI's budget is spent almost entirely in the second (docs/compat.md "CI time").
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from core_support import clean_env, host_kind, module_dir, plugin_site, table, vllm_not_loaded

__all__ = ["clean_env", "host_kind", "module_dir", "plugin_site", "table", "vllm_not_loaded"]


class PhaseClock:
    """Sums setup + call + teardown seconds per test into ``unit`` and ``e2e`` (marker ``vllm``).

    Registered as a plugin (not a conftest hook) so it also sees plugins/*/tests. Tests run one
    after another, so the sums are wall time (a test waiting on a background vLLM run is charged
    the wait).
    """

    def __init__(self) -> None:
        self.seconds = {"unit": 0.0, "e2e": 0.0}
        self.counts = {"unit": 0, "e2e": 0}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        phase = "e2e" if "vllm" in report.keywords else "unit"
        self.seconds[phase] += report.duration
        if report.when == "call" or (report.when == "setup" and report.skipped):
            self.counts[phase] += 1

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        log = os.environ.get("QUANTREG_PHASE_LOG")
        for phase in ("unit", "e2e"):
            line = f"phase {phase}: {self.seconds[phase]:.0f} s ({self.counts[phase]} tests)"
            terminalreporter.write_line(line)
            if log:
                with open(log, "a", encoding="utf-8") as f:
                    f.write(line + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin("quantreg-phase-clock"):
        config.pluginmanager.register(PhaseClock(), "quantreg-phase-clock")
