"""The fingerprint check (quantreg/vllm/fingerprint.py): a process that decides differently is named.

Issue 21, class 6: a fault drops exactly the bad piece (one WARNING) and the fingerprint check
notices the process that therefore decides differently. Unit level: :class:`PublishedFingerprint`
itself; then real ``register()`` in fresh processes, with a real installed plugin whose
``register_tables`` hook fails in one process only (``tests/e2e/e2e_plugin/quantreg_e2e_flaky.py``;
the same plugin runs in real vLLM in tests/e2e/test_fingerprint_vllm.py).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from core_support import installed_copy

from quantreg import settings
from quantreg.problems import QuantregError
from quantreg.vllm.fingerprint import PublishedFingerprint

HERE = Path(__file__).resolve().parent
FLAKY = HERE / "e2e" / "e2e_plugin"
MISMATCH = "loaded a different effective table"
KEY = ("unquantized", "gpt_oss", "cpu")
VAR = settings.FINGERPRINT

#: One library process's start-up: the real register(), then what its registry decides for KEY.
PROCESS = f"""
import json, logging, os, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
import quantreg.vllm as qv
from quantreg.problems import QuantregError
from quantreg.registry import get_registry
try:
    qv.register()
except QuantregError as exc:
    print("STRICT-FAIL", exc, file=sys.stderr)
    sys.exit(3)
decision = get_registry().resolve({KEY!r})
print(json.dumps(dict(pid=os.getpid(), method=decision.method, source=decision.source,
                      published=os.environ.get("QUANTREG_FINGERPRINT"), fingerprint=get_registry().fingerprint())))
"""


def _fingerprint(monkeypatch: pytest.MonkeyPatch) -> PublishedFingerprint:
    monkeypatch.delenv(VAR, raising=False)
    return PublishedFingerprint(VAR, "effective table", "its parent process", "a table file or plugin changed")


def test_the_first_process_publishes_and_an_equal_one_is_silent(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    check = _fingerprint(monkeypatch)
    check.check("aaaa", strict=True, role="MainProcess")
    assert os.environ[VAR] == "aaaa" and check.published == "aaaa"
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg"):
        check.check("aaaa", strict=True, role="EngineCore")
    assert caplog.records == []
    check.withdraw()
    assert VAR not in os.environ


@pytest.mark.parametrize("left_out", [0, 2])
def test_a_different_process_is_one_warning_naming_it_and_both_fingerprints(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, left_out: int) -> None:
    check = _fingerprint(monkeypatch)
    monkeypatch.setenv(VAR, "parentfp")
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg"):
        check.check("childfp", strict=False, role="Worker_TP1", left_out=left_out)
    assert len(caplog.records) == 1
    text = caplog.records[0].getMessage()
    assert f"this process (Worker_TP1, pid {os.getpid()})" in text and "childfp" in text and "parentfp" in text
    assert ("left out 2 piece(s)" in text) == bool(left_out)
    assert os.environ[VAR] == "parentfp"  # a later process never replaces the first one's


def test_strict_a_different_process_is_one_error_line(monkeypatch: pytest.MonkeyPatch) -> None:
    check = _fingerprint(monkeypatch)
    monkeypatch.setenv(VAR, "parentfp")
    with pytest.raises(QuantregError) as raised:
        check.check("childfp", strict=True, role="EngineCore", left_out=1)
    text = str(raised.value)
    assert "\n" not in text and "(EngineCore, pid" in text and "childfp" in text and "parentfp" in text


def test_a_forged_role_or_published_value_cannot_forge_a_log_line(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    check = _fingerprint(monkeypatch)
    monkeypatch.setenv(VAR, "p\nWARNING forged\x1b[2J")
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg"):
        check.check("childfp", strict=False, role="Worker\nERROR x")
    text = caplog.records[0].getMessage()
    assert "\n" not in text and "\x1b" not in text


# -- real register() in fresh processes, a real installed plugin failing in one of them ---------

@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The flaky plugin installed (a dist-info on PYTHONPATH) and the table its hook registers."""
    root = installed_copy(tmp_path_factory.mktemp("flaky-site"), FLAKY, ("quantreg_e2e_flaky.py",),
                          "quantreg-e2e-flaky", "flaky = quantreg_e2e_flaky")
    table = root / "flaky.yaml"
    table.write_text("version: 1\nrules:\n  - match: {quant_format: unquantized, model_type: gpt_oss}\n"
                     "    method: vllm\n    options: {}\n    note: e2e flaky table\n")
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {"PYTHONPATH": path, "E2E_FLAKY_TABLE": str(table), "QUANTREG_CONFIG": "", "QUANTREG_CACHE_DIR": "off"}


def run_process(env: dict[str, str], expect_rc: int = 0) -> tuple[dict[str, Any], str]:
    base = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    out = subprocess.run([sys.executable, "-c", PROCESS], capture_output=True, text=True, env={**base, **env},
                         timeout=120)  # fails the test instead of hanging it
    assert out.returncode == expect_rc, out.stderr[-4000:]
    return ({} if expect_rc else json.loads(out.stdout.strip().splitlines()[-1])), out.stderr


@pytest.mark.vllm_installed  # register() is inert where vLLM's MoE module does not exist
def test_a_process_whose_hook_failed_is_noticed_by_the_fingerprint(site: dict[str, str]) -> None:
    first, first_log = run_process(site)
    assert first["published"] == first["fingerprint"] and MISMATCH not in first_log
    # a later process of the same server: inherits the published fingerprint; only there the hook fails
    later, log = run_process({**site, "QUANTREG_FINGERPRINT": first["published"], "E2E_FLAKY_FAILS_IN": "MainProcess"})
    warnings = [line for line in log.splitlines() if line.startswith("WARNING")]
    dropped = [line for line in warnings if "register_tables" in line]
    mismatch = [line for line in warnings if MISMATCH in line]
    assert len(dropped) == 1 and "'flaky'" in dropped[0] and "left out" in dropped[0], warnings
    assert len(mismatch) == 1, warnings
    assert later["fingerprint"] != first["fingerprint"]
    assert "flaky.yaml" in str(first["source"]) and "flaky.yaml" not in str(later["source"])  # decides differently
    assert later["fingerprint"] in mismatch[0] and first["fingerprint"] in mismatch[0]
    assert f"(MainProcess, pid {later['pid']})" in mismatch[0] and "left out 1 piece(s)" in mismatch[0]
    assert later["published"] == first["published"]  # the first process's value stays
    # strict: the dropped piece is refused in that process with one line, before anything is decided
    _, strict_log = run_process({**site, "QUANTREG_FINGERPRINT": first["published"],
                                 "E2E_FLAKY_FAILS_IN": "MainProcess", "QUANTREG_STRICT": "1"}, expect_rc=3)
    lines = [line for line in strict_log.splitlines() if "STRICT-FAIL" in line]
    assert len(lines) == 1 and "'flaky'" in lines[0] and "register_tables" in lines[0], strict_log
    assert "Traceback" not in strict_log


@pytest.mark.vllm_installed
def test_a_hook_that_leaves_no_rule_behind_still_changes_the_fingerprint(site: dict[str, str]) -> None:
    """A keepers (or limitations, findings) hook failing in one process drops no rule, yet that
    process handles vLLM's quant config differently: the failed hook is part of the fingerprint."""
    first, _ = run_process(site)
    keepers_fail = {"E2E_FLAKY_FAILS_IN": "MainProcess", "E2E_FLAKY_HOOKS": "register_quant_config_keepers"}
    later, log = run_process({**site, **keepers_fail, "QUANTREG_FINGERPRINT": first["published"]})
    assert later["source"] == first["source"]  # the rules are the same ...
    assert later["fingerprint"] != first["fingerprint"]  # ... the registries are not
    mismatch = [line for line in log.splitlines() if MISMATCH in line]
    assert len(mismatch) == 1 and "left out 1 piece(s)" in mismatch[0], log
    # two processes that fail alike agree with each other
    again, _ = run_process({**site, **keepers_fail})
    assert again["fingerprint"] == later["fingerprint"]
