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
from pathlib import Path

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
    hooks_only = (".plugin", ".keeper")  # plugin #1's hook module and its keeper value (strings only)
    assert not [m for m in added if m.startswith("quantreg_hpu_mxfp4.") and not m.endswith(hooks_only)], added
    # the MoE seam's hook, the dense seam's three (linear layers, the lm_head, the model loader) and
    # plugin #1's keeper hook; registering twice arms each once
    assert result["armed"] == 5
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


def test_register_warns_once_when_vllm_is_outside_the_tested_range() -> None:
    """The start-up log names an untested vLLM once per process (the version read from metadata)."""
    result = run_py("""
        import json, logging
        logging.basicConfig(level=logging.INFO, format="%(name)s|%(levelname)s|%(message)s")
        import quantreg.vllm as qv
        from quantreg.vllm import versions
        installed = versions.installed_vllm_version()
        qv.register()
        qv.unregister()
        versions.installed_vllm_version = lambda: "0.33.0"  # what register() reads, as a newer vLLM would report
        qv.register(); qv.unregister(); qv.register()
        print(json.dumps(dict(installed=installed, inside=versions.check_tested(installed) is None,
                              expected=versions.check_tested("0.33.0"))))
    """)
    stderr = str(result["stderr"])
    untested = [x for x in stderr.splitlines() if "outside the tested range" in x]
    assert untested == [f"vllm.quantreg|WARNING|{result['expected']}"]  # once, for the fake version only
    assert "vLLM 0.33.0 is outside the tested range" in untested[0]
    if result["inside"]:
        assert f"vLLM {result['installed']} is" not in untested[0]


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
    """Bad run settings are located problems on the settings, never an exception (tests/test_settings.py)."""
    from quantreg.vllm.context import parse_run_settings

    assert parse_run_settings({"config": "a.yaml", "strict": True}).config == ("a.yaml",)
    run = parse_run_settings({"confg": ["a.yaml"], "strict": "yes"})
    text = "\n".join(map(str, run.problems))
    assert "quantreg.confg: unknown key" in text and "quantreg.strict: expected true or false" in text
    assert run.strict is True and run.config == ()


def test_seam_builds_plain_and_context_classes(tmp_path: Path) -> None:
    """Through the real seam (real vLLM imports and FusedMoEMethodBase): both construction forms."""
    table = tmp_path / "build.yaml"
    table.write_text("version: 1\nrules:\n"
                     "  - match: {quant_format: plain_fmt}\n    method: plain\n    options: {alpha: 2}\n"
                     "  - match: {quant_format: ctx_fmt}\n    method: with_context\n    options: {alpha: 3}\n")
    result = run_py("""
        import json, os
        from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
        import quantreg
        from quantreg.registry import Registry, set_registry
        from quantreg.vllm.seam import Seam

        class Base(FusedMoEMethodBase):
            def create_weights(self, *a, **k): pass
            def get_fused_moe_quant_config(self, *a, **k): pass

        class Plain(Base):
            def __init__(self, moe, **options):
                self.moe, self.options = moe, options

        class WithContext(Base):
            def __init__(self, moe, quantreg_context=None, **options):
                self.moe, self.context, self.options = moe, quantreg_context, options

        class Plugin:
            @quantreg.hookimpl
            def register_methods(self, register):
                register(quantreg.Method(name="plain", target="__main__:Plain"))
                register(quantreg.Method(name="with_context", target="__main__:WithContext"))

        class Config:
            def __init__(self, name): self.name = name
            def get_name(self): return self.name

        set_registry(Registry.build(config=[os.environ["QRT_TABLE"]], env={}, entry_points=False,
                                    plugins=[("qrt_build", Plugin())]))
        seam, layer = Seam(), object()
        plain = seam.route(lambda *a: "VLLM-OWN", layer, "model.layers.0.mlp.experts", Config("plain_fmt"), "MOE")
        new = seam.route(lambda *a: "VLLM-OWN", layer, "model.layers.1.mlp.experts", Config("ctx_fmt"), "MOE")
        c = new.context
        print(json.dumps({"plain": [type(plain).__name__, plain.moe, plain.options],
                          "new": [type(new).__name__, new.moe, new.options],
                          "context": [list(c.key), c.method, c.rule, dict(c.options), c.prefix, c.layer is layer]}))
    """, env={"QRT_TABLE": str(table)})
    assert result["plain"] == ["Plain", "MOE", {"alpha": 2}]
    assert result["new"] == ["WithContext", "MOE", {"alpha": 3}]
    assert result["context"] == [["ctx_fmt", "unknown", "cpu"], "with_context", f"{table}:6", {"alpha": 3},
                                 "model.layers.1.mlp.experts", True]
