"""Per-run tables at start-up (issue 16 item 2) and the one-line strict exit (item 1), without a model.

Each case runs in a fresh interpreter and calls vLLM's real ``load_general_plugins()`` from a
function holding a real ``VllmConfig`` as ``vllm_config`` -- exactly how ``EngineCore.__init__``
and ``WorkerWrapperBase.init_worker`` call it in vLLM 0.32, the earliest point where a process
holds ``additional_config`` (see quantreg/vllm/startup.py). The strict case runs that in a
``spawn`` child named ``EngineCore``, as vLLM starts it. The full servers are in
tests/e2e/test_serving.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from core_support import QUANTREG_VARS

from quantreg.problems import QuantregError
from quantreg.vllm import startup

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

ROUTE = """\
version: 1
rules:
  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}
    method: vllm
    priority: 7
"""
BROKEN = """\
version: 1
rules:
  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}
    method: no_such_method
"""

#: vLLM's calling pattern in miniature; prints what the process's registry holds afterwards.
PROBE = textwrap.dedent("""
    import json, multiprocessing, os, sys


    def engine_core_init(vllm_config):  # as vllm/v1/engine/core.py:118-129: config local, then plugins
        from vllm.plugins import load_general_plugins

        load_general_plugins()


    def main(additional):
        from vllm.config import VllmConfig

        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging

        vllm_config = VllmConfig(additional_config=additional)
        configure_logging(getattr(vllm_config, "logging_config", None) or LoggingConfig())  # as run_engine_core
        engine_core_init(vllm_config)
        from quantreg.registry import get_registry

        registry = get_registry()
        print("RESULT " + json.dumps({
            "tables": [[t.path, str(t.tier)] for t in registry.tables],
            "fingerprint": registry.fingerprint(),
            "run_fingerprint": os.environ.get("QUANTREG_RUN_FINGERPRINT"),
            "base_fingerprint": os.environ.get("QUANTREG_FINGERPRINT"),
        }), flush=True)


    if __name__ == "__main__":
        additional = json.loads(sys.argv[1])
        if sys.argv[2] == "child":
            child = multiprocessing.get_context("spawn").Process(target=main, args=(additional,), name="EngineCore")
            child.start()
            child.join(300)
            print(f"CHILD EXIT {child.exitcode}", flush=True)
        else:
            main(additional)
""")


def run_probe(tmp_path: Path, additional: dict[str, object], where: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in QUANTREG_VARS and not k.startswith("QUANTREG_")}
    env.update(QUANTREG_PLUGINS="", VLLM_PLUGINS="quantreg", NO_COLOR="1")
    return subprocess.run([sys.executable, str(script), json.dumps(additional), where], capture_output=True,
                          text=True, env=env, timeout=300, cwd=tmp_path)


def result_of(out: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    [line] = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    data: dict[str, object] = json.loads(line[len("RESULT "):])
    return data


@pytest.mark.vllm
def test_run_tables_are_read_when_vllm_loads_plugins(tmp_path: Path) -> None:
    route = tmp_path / "route.yaml"
    route.write_text(ROUTE)
    out = run_probe(tmp_path, {"quantreg": {"config": [str(route)]}}, "here")
    data = result_of(out)
    tables = data["tables"]
    assert isinstance(tables, list) and tables[-1] == [str(route), "run"]
    log = out.stdout + out.stderr
    [loaded] = [x for x in log.splitlines() if "quantreg: registry loaded" in x]
    assert f"from {len(tables)} tables (1 from additional_config)" in loaded, loaded
    assert f"fingerprint {data['fingerprint']}" in loaded
    # The whole registry (run table included) is published for the Workers; the base one stays the env's.
    assert data["run_fingerprint"] == data["fingerprint"] and data["base_fingerprint"] != data["fingerprint"]


@pytest.mark.vllm
def test_without_a_visible_config_register_keeps_the_environment_tables(tmp_path: Path) -> None:
    """The driver's case (no config local above register()): only the environment's tables."""
    script = "import json, quantreg.vllm as qv; from quantreg.registry import get_registry\n" \
             "qv.register(); print('RESULT ' + json.dumps([str(t.tier) for t in get_registry().tables]))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    env["QUANTREG_PLUGINS"] = ""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    [line] = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert json.loads(line[len("RESULT "):]) == ["default"]


@pytest.mark.vllm
def test_strict_broken_run_table_ends_an_engine_core_child_with_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(BROKEN)
    out = run_probe(tmp_path, {"quantreg": {"config": [str(broken)], "strict": True}}, "child")
    log = out.stdout + out.stderr
    assert out.returncode == 0 and "CHILD EXIT 1" in out.stdout, log[-4000:]
    assert "RESULT " not in out.stdout  # it stopped at register(), before anything after plugin loading
    every = [x for x in log.splitlines() if "quantreg (strict)" in x]
    assert len(every) == 1, log[-4000:]
    assert "ERROR" in every[0] and every[0].split("] ", 1)[-1].startswith("quantreg (strict): ")
    assert f"{broken}:4: rules[0].method: unknown method 'no_such_method'" in every[0]
    assert "Traceback" not in log


@pytest.mark.vllm
def test_strict_broken_run_table_in_process_raises_without_a_chained_context(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(BROKEN)
    out = run_probe(tmp_path, {"quantreg": {"config": [str(broken)], "strict": True}}, "here")
    assert out.returncode == 1
    assert "During handling" not in out.stderr  # raised from None: no chained copy of the error
    assert [x for x in out.stderr.splitlines() if x.startswith("quantreg.problems.QuantregError")] == \
        [out.stderr.rstrip().splitlines()[-1]]
    assert out.stderr.rstrip().splitlines()[-1].startswith("quantreg.problems.QuantregError: quantreg (strict): ")


def test_strict_text_is_one_line() -> None:
    assert startup.strict_text(QuantregError("quantreg (strict): a; b")) == "quantreg (strict): a; b"
    assert startup.strict_text(QuantregError("a.yaml:1: x: bad\nb.yaml:2: y: worse")) == \
        "quantreg (strict): a.yaml:1: x: bad; b.yaml:2: y: worse"
    assert startup.strict_text(QuantregError("quantreg: this process differs")) == \
        "quantreg (strict): this process differs"


def test_the_test_process_is_not_a_vllm_child() -> None:
    assert startup.in_vllm_child() is False
    with pytest.raises(QuantregError) as info:
        startup.fail_strict(QuantregError("quantreg (strict): stop"))
    assert info.value.__suppress_context__


def test_caller_vllm_config_needs_vllms_own_class() -> None:
    class VllmConfig:  # same name, not vLLM's module: not taken
        def __init__(self) -> None:
            self.additional_config = {"quantreg": {"config": ["x.yaml"]}}

    vllm_config = VllmConfig()
    assert vllm_config.additional_config
    assert startup.caller_vllm_config(sys._getframe()) is None
    assert startup.startup_settings(sys._getframe()) is None
