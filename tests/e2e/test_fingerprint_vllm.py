"""The fingerprint check notices a vLLM process that decides differently after dropping a piece.

Issue 21, class 6: a fault drops exactly the bad piece (one WARNING), and the fingerprint check
(:mod:`quantreg.vllm.fingerprint`) notices a process that therefore decides differently. What it
compares: the first process to register (the driver, ``LLM(...)``) publishes its fingerprint in
``QUANTREG_FINGERPRINT``; EngineCore and the Worker (which builds every layer) compare their own.

The dropped piece: a real installed plugin (``e2e_plugin/quantreg_e2e_flaky.py``) whose
``register_tables`` hook raises only in the Worker. Its table routes the bf16 twin's MoE layers
to ``e2e_unquantized`` (vLLM's own method under another class name), so the driver's and
EngineCore's registries hold that rule and the Worker's does not: the Worker builds vLLM's class. Lenient: the run goes
on, with one WARNING for the dropped hook and one naming both fingerprints and the process.
Strict: one ``quantreg (strict): ...`` line and the start fails. Two vLLM starts, overlapped.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from core_support import installed_copy

HERE = Path(__file__).resolve().parent
E2E_CLASS = "quantreg_e2e_methods:E2EUnquantizedMethod"
UNQUANTIZED_KEY = "{quant_format: unquantized, model_type: gpt_oss}"
MISMATCH = "loaded a different effective table"
FINGERPRINT_LINE = re.compile(r"quantreg: registry loaded, .* fingerprint (\w+) \(pid (\d+)\)")
PROMPTS = [[1, 2, 3, 4, 5]]
#: The multiprocessing name of vLLM's Worker processes (``VllmWorker-0``; its log prefix later says ``Worker``).
WORKER = "VllmWorker"
THIS_WORKER = re.compile(r"this process \((?:VllmWorker|Worker)[-\w]*, pid (\d+)\)")
#: Fails the test (RunnerTimeout) instead of hanging it; one start is 20-90 s here.
TIMEOUT = 300.0


@pytest.fixture(scope="module")
def flaky_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The e2e plugin (for ``e2e_unquantized``) and the flaky plugin, installed in one sys.path entry."""
    root = tmp_path_factory.mktemp("flaky-site")
    installed_copy(root, HERE / "e2e_plugin", ("quantreg_e2e_plugin.py", "quantreg_e2e_methods.py"),
                   "quantreg-e2e-plugin", "e2e = quantreg_e2e_plugin")
    return installed_copy(root, HERE / "e2e_plugin", ("quantreg_e2e_flaky.py",), "quantreg-e2e-flaky",
                          "flaky = quantreg_e2e_flaky")


@pytest.fixture(scope="module")
def runs(vllm_run: Any, tiny_model_bf16: Path, flaky_site: Path,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both starts at once (lenient, strict); each the RunResult."""
    table = tmp_path_factory.mktemp("flaky-table") / "flaky.yaml"
    table.write_text(f"version: 1\nrules:\n  - match: {UNQUANTIZED_KEY}\n    method: e2e_unquantized\n")
    path = os.pathsep.join([str(flaky_site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    base = {"PYTHONPATH": path, "QUANTREG_CONFIG": "", "E2E_FLAKY_TABLE": str(table),
            "E2E_FLAKY_FAILS_IN": WORKER}
    futures = {mode: vllm_run.start(tiny_model_bf16, prompts=PROMPTS, max_tokens=2, timeout=TIMEOUT,
                                    env={**base, "QUANTREG_STRICT": "1" if mode == "strict" else "0"})
               for mode in ("lenient", "strict")}
    return {mode: future.result() for mode, future in futures.items()}


def _lines(log: str, text: str) -> list[str]:
    return [line for line in log.splitlines() if text in line]


def test_lenient_a_process_that_dropped_a_hook_is_named_with_both_fingerprints(runs: dict[str, Any]) -> None:
    result = runs["lenient"]
    assert result.ok, result.log[-3000:]
    assert result.token_ids and len(result.token_ids[0]) == 2
    dropped = _lines(result.log, "register_tables")
    assert len(dropped) == 1 and "WARNING" in dropped[0] and "'flaky'" in dropped[0], dropped
    assert f"e2e flaky: no table in process {WORKER}-0" in dropped[0] and "left out" in dropped[0]
    # the Worker decided without the flaky table: vLLM's own class, not the table's
    methods = set(result.moe_quant_methods.values())
    assert methods and all(m.endswith(":UnquantizedFusedMoEMethod") for m in methods), methods
    loaded = {pid: fp for fp, pid in FINGERPRINT_LINE.findall(result.log)}
    assert result.driver_fingerprint, "the driver published no fingerprint"
    mismatch = _lines(result.log, MISMATCH)
    assert len(mismatch) == 1, mismatch
    line = mismatch[0]
    found = THIS_WORKER.search(line)
    assert "WARNING" in line and found is not None, line
    worker_pid = found.group(1)
    assert worker_pid in {str(p) for p in result.worker_pids}, (worker_pid, result.worker_pids)
    worker = loaded[worker_pid]
    assert worker != result.driver_fingerprint and worker in line and result.driver_fingerprint in line, line
    assert "left out 1 piece(s)" in line, line
    # every other process that logged its registry (EngineCore) holds the driver's fingerprint
    assert {fp for pid, fp in loaded.items() if pid != worker_pid} == {result.driver_fingerprint}, loaded


def test_strict_the_process_that_drops_a_piece_ends_the_start_with_one_line(runs: dict[str, Any]) -> None:
    result = runs["strict"]
    assert not result.ok and not result.token_ids
    strict = _lines(result.log, "quantreg (strict):")
    assert len(strict) == 1, strict
    assert "ERROR" in strict[0] and "'flaky'" in strict[0] and "register_tables" in strict[0], strict
    assert f"e2e flaky: no table in process {WORKER}-0" in strict[0]
    frames = [line for line in _lines(result.log, 'File "')
              if "/quantreg/" in line and "/quantreg/testing/" not in line]
    assert frames == [], "a traceback through quantreg was printed"
