"""The start-up hook without building a model: cheap, idempotent, lazy, undoable.

These run in fresh subprocesses because the hook's whole point is what a *new* vLLM process
imports; they need vLLM installed (they are skipped in the torch-free environment).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
import types

import pytest

# find_spec, not importorskip: importing vLLM into the test process would change other tests.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

MODULE = "vllm.model_executor.layers.fused_moe.routed_experts"


def run_py(code: str, env: dict[str, str] | None = None) -> dict[str, object]:
    import os

    full_env = {**os.environ, **(env or {})}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env=full_env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    result: dict[str, object] = json.loads(last)
    result["stderr"] = out.stderr
    return result


def test_register_is_cheap_lazy_and_idempotent() -> None:
    result = run_py(f"""
        import json, sys
        import vllm
        before = set(sys.modules)
        import quantreg.vllm as qv
        qv.register(); qv.register()
        added = sorted(set(sys.modules) - before)
        armed = sum(type(f).__name__ == "PostImportHook" for f in sys.meta_path)
        installed_before = qv.installed()
        import {MODULE} as m
        wrapped = getattr(m.RoutedExperts._get_quant_method, "__quantreg_original__", None) is not None
        qv.unregister()
        restored = getattr(m.RoutedExperts._get_quant_method, "__quantreg_original__", None) is None
        print(json.dumps(dict(added=added, armed=armed, installed_before=installed_before,
                              wrapped=wrapped, restored=restored)))
    """)
    added = result["added"]
    assert isinstance(added, list)
    assert not [m for m in added if m.startswith("vllm.model_executor")], added
    assert not [m for m in added if m.startswith("quantreg_hpu_mxfp4.") and not m.endswith(".plugin")], added
    assert result["armed"] == 1  # registering twice arms one hook
    assert result["installed_before"] is False  # nothing patched until vLLM imports the module itself
    assert result["wrapped"] is True
    assert result["restored"] is True


def test_register_after_module_import_patches_at_once() -> None:
    result = run_py(f"""
        import json
        import {MODULE} as m
        import quantreg.vllm as qv
        qv.register()
        print(json.dumps(dict(installed=qv.installed(),
                              wrapped=hasattr(m.RoutedExperts._get_quant_method, "__quantreg_original__"))))
    """)
    assert result == {**result, "installed": True, "wrapped": True}


def test_registration_logs_fingerprint_through_vllm_logger() -> None:
    result = run_py("""
        import json, logging
        logging.basicConfig(level=logging.INFO, format="%(name)s|%(levelname)s|%(message)s")
        import quantreg.vllm as qv
        qv.register()
        print(json.dumps({}))
    """)
    stderr = str(result["stderr"])
    line = next(x for x in stderr.splitlines() if "quantreg: registry loaded" in x)
    assert line.startswith("vllm.quantreg|INFO|") and "fingerprint" in line


def test_seam_missing_in_this_vllm_warns_and_leaves_module_alone(caplog: pytest.LogCaptureFixture) -> None:
    from quantreg.vllm.seam import Seam

    old_vllm = types.ModuleType(MODULE)  # a vLLM build whose module has no RoutedExperts class
    seam = Seam()
    with caplog.at_level("WARNING", logger="vllm.quantreg"):
        seam.patch_module(old_vllm)
    assert seam.patched is None
    assert vars(old_vllm).keys() == {"__name__", "__doc__", "__package__", "__loader__", "__spec__"}
    assert any("quantreg is inactive" in r.getMessage() for r in caplog.records)


def test_additional_config_is_checked() -> None:
    from quantreg.problems import QuantregError
    from quantreg.vllm.context import parse_run_settings

    assert parse_run_settings({"config": "a.yaml", "strict": True}).config == ("a.yaml",)
    with pytest.raises(QuantregError) as err:
        parse_run_settings({"confg": ["a.yaml"], "strict": "yes"})
    text = str(err.value)
    assert "quantreg.confg: unknown key" in text and "quantreg.strict: expected true or false" in text
