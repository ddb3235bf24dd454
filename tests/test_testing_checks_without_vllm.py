"""The plugin author kit (``quantreg.testing``) without torch or vLLM: neither is imported by the kit
or its pytest plugin; an unregistered method fails with a suggestion and skips the rest; ``vllm``
stands for no class; a report never counts a skip as a pass; declarations and probe failures say
what to change, and good ones pass without importing the class. The checks that build layers are in
test_testing_conformance.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest
from kit_support import _Plugin, method, statuses

from quantreg import Registry
from quantreg.testing import CHECK_IDS, CheckResult, Report, Status, checks, run_checks

# -- without torch or vLLM --------------------------------------------------------------------------


def test_kit_and_pytest_plugin_import_neither_torch_nor_vllm() -> None:
    code = ("import sys, quantreg.testing, quantreg.testing.pytest_plugin, quantreg.cli\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_unregistered_method_fails_with_suggestion_and_skips_the_rest() -> None:
    registry = Registry.build(entry_points=False, plugins=[("qrt", _Plugin(method("qrt_example")))])
    report = run_checks("qrt_exmaple", registry=registry)
    assert [r.check for r in report.results] == list(CHECK_IDS)
    first = report.results[0]
    assert first.status is Status.FAIL and "did you mean 'qrt_example'" in first.detail
    assert {r.status for r in report.results[1:]} == {Status.SKIPPED} and not report.ok


def test_vllm_stands_for_no_class_and_is_not_checked() -> None:
    report = run_checks("vllm", registry=Registry.build(entry_points=False))
    assert report.ok and {r.status for r in report.results} == {Status.SKIPPED}
    assert "vLLM's own method" in report.results[0].detail


def test_report_never_counts_a_skip_as_a_pass() -> None:
    report = Report("m", "cpu", target="pkg:C", plugin="p", availability="runs on hpu, not cpu", tolerance=0.01,
                    quant_format="gpt_oss_mxfp4")
    report.results = [CheckResult("subclass", "t", Status.PASS, "ok"),
                      CheckResult("forward-bias", "t", Status.SKIPPED, "needs a device", True)]
    assert report.ok and "no failures -- 1 passed, 0 failed, 1 skipped" in report.render()
    assert "conforms" not in report.render()  # only a run without skips "conforms"
    data = json.loads(json.dumps(report.to_json()))
    assert data["counts"] == {"PASS": 1, "FAIL": 0, "SKIPPED": 1} and data["ok"] is True
    report.results.append(CheckResult("weights", "t", Status.FAIL, "bad"))
    assert not report.ok and "FAILS" in report.summary()


def _probe_raises() -> tuple[bool, str]:
    raise RuntimeError("device query crashed")


def _probe_slow() -> tuple[bool, str]:
    time.sleep(1.0)
    return True, "late"


@pytest.mark.parametrize(("fields", "check", "expected"), [
    ({"options": None}, "declarations", "options is None"),
    ({"devices": ()}, "declarations", "devices is empty"),
    ({"devices": ("Gaudi 3",)}, "declarations", "not a vLLM device type"),
    ({"requires": ("habana-frameworks",)}, "declarations", "not a module name"),
    ({"probe": _probe_raises}, "probe", "raised RuntimeError: device query crashed"),
    ({"probe": _probe_slow}, "probe", "no answer within 0.2 s"),
    ({"probe": lambda: ("yes", 1)}, "probe", "returns (ok: bool, reason: str)"),
    ({"probe": lambda: (False, " ")}, "probe", "empty reason"),
    ({"probe": "qrt_nowhere.probe:ok"}, "probe", "ModuleNotFoundError"),
])
def test_declarations_and_probe_failures_say_what_to_change(monkeypatch: pytest.MonkeyPatch,
                                                            fields: dict[str, Any], check: str,
                                                            expected: str) -> None:
    monkeypatch.setattr(checks, "PROBE_BUDGET_S", 0.2)
    report = run_checks(method(**fields), only=["declarations", "probe"])
    result = report.result(check)
    assert result.status is Status.FAIL and expected in result.detail, result.detail


def test_good_declarations_and_probe_pass_without_importing_the_class() -> None:
    report = run_checks(method(target="qrt_nowhere:Nothing", probe=lambda: (False, "no such device here")),
                        only=["declarations", "probe"])
    assert statuses(report) == {"declarations": Status.PASS, "probe": Status.PASS}
    assert "(False, 'no such device here')" in report.result("probe").detail
