"""Names vLLM never uses in a key are flagged with did-you-mean (issue 22 class 5)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from core_support import run_cli

from quantreg.keys import Key
from quantreg.vllm.names import VLLM_QUANT_FORMATS, key_warnings

ENV = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}


def test_the_static_list_is_vllms_registry_of_quantization_methods() -> None:
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    assert sorted(QUANTIZATION_METHODS) == sorted(set(VLLM_QUANT_FORMATS) - {"unquantized"})


def test_key_warnings_name_vllms_spelling() -> None:
    [fmt] = key_warnings(Key("mxfp4", "gpt_oss", "cpu"))
    assert "did you mean 'gpt_oss_mxfp4'?" in fmt and "quantreg plan MODEL_DIR" in fmt
    [dev] = key_warnings(Key("gpt_oss_mxfp4", "gpt_oss", "gpu"))
    assert "'gpu' is no device name vLLM uses; did you mean 'cuda'?" in dev
    [typo] = key_warnings(Key("fp9", "llama", "cpu"))
    assert "did you mean 'fp8'?" in typo
    assert key_warnings(Key("gpt_oss_mxfp4", "gpt_oss", "cpu")) == []
    assert key_warnings(Key("my_format", "x", "my_dev"), formats=["my_format"], devices=["my_dev"]) == []


def test_explain_warns_on_stderr_and_in_json() -> None:
    out = run_cli("explain", "mxfp4", "gpt_oss", "gpu", "--json", env={**ENV, "QUANTREG_PLUGINS": ""})
    assert out.returncode == 0, out.stderr
    warned = [line for line in out.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 2 and "gpt_oss_mxfp4" in warned[0] and "'cuda'" in warned[1], out.stderr
    assert json.loads(out.stdout)["key_warnings"] == [w.removeprefix("warning: ") for w in warned]


def test_validate_warns_located_but_does_not_fail(tmp_path: Path) -> None:
    table = tmp_path / "t.yaml"
    table.write_text("version: 1\nrules:\n  - match: {quant_format: gpt_oss_mxfp4, device: cpu}\n    method: vllm\n"
                     "  - match: {quant_format: mxfp4, model_type: gpt_oss, device: gpu}\n    method: vllm\n")
    out = run_cli("validate", "--json", str(table), env={**ENV, "QUANTREG_PLUGINS": ""})
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout)
    assert data["ok"] is True and len(data["warnings"]) == 2
    assert data["warnings"][0].startswith(f"{table}:5: match.quant_format: ") and "gpt_oss_mxfp4" in data["warnings"][0]
    assert data["warnings"][1].startswith(f"{table}:5: match.device: ") and "'cuda'" in data["warnings"][1]


@pytest.mark.parametrize("command", [["list"], ["check-method", "vllm"]])
def test_a_device_option_vllm_never_reports_is_flagged(command: list[str]) -> None:
    """``--device gpu`` answered silently in list and check-method (only explain's positional warned)."""
    out = run_cli(*command, "--device", "gpu", env={**ENV, "QUANTREG_PLUGINS": ""})
    warned = [line for line in out.stderr.splitlines() if line.startswith("warning: ")]
    assert warned == ["warning: --device gpu: 'gpu' is no device name vLLM uses; did you mean 'cuda'? "
                      "(`quantreg plan MODEL_DIR` prints a checkpoint's exact key)"], out.stderr
    assert "Traceback" not in out.stderr
    quiet = run_cli(*command, "--device", "cuda", env={**ENV, "QUANTREG_PLUGINS": ""})
    assert not [line for line in quiet.stderr.splitlines() if "no device name" in line], quiet.stderr


def test_plan_flags_a_device_vllm_never_reports_under_that_device(tmp_path: Path) -> None:
    from quantreg.models.gpt_oss import tiny_gpt_oss_config  # no torch: config.json alone names the key

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_gpt_oss_config()))
    out = run_cli("plan", str(model), "--device", "gpu", "--device", "cuda", "--no-vllm", "--json",
                  env={**ENV, "QUANTREG_PLUGINS": ""})
    assert out.returncode == 0, out.stderr
    devices = json.loads(out.stdout)["devices"]
    assert devices["gpu"]["warnings"][0].startswith("'gpu' is no device name vLLM uses; did you mean 'cuda'?")
    assert not [w for w in devices["cuda"]["warnings"] if "no device name" in w]
