"""Plugin #1 and vllm-gaudi: the keeper of its GPT-OSS MXFP4 switch and the doctor findings.

vllm-gaudi cannot be installed here; its ``models/gptoss_mxfp4.py`` is stood in for by a module
with the same name and the same reader shape (a module global tested for truth when the patched
functions run). Real vLLM runs with a faithful double live in ``tests/e2e/test_vllm_gaudi.py``.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from quantreg_hpu_mxfp4 import vllm_gaudi
from quantreg_hpu_mxfp4.vllm_gaudi import TableSwitch, findings, keep_native

import quantreg
from quantreg.vllm.quantconfig import collect_keepers


def gaudi_module(native: bool) -> types.ModuleType:
    """vllm-gaudi's reader shape: ``if not HPU_MXFP4_NATIVE and model_type == "gpt_oss"`` at call time."""
    module = types.ModuleType(vllm_gaudi.MODULE)
    module.HPU_MXFP4_NATIVE = native  # type: ignore[attr-defined]
    source = ("def strips(model_type):\n    return not HPU_MXFP4_NATIVE and model_type == 'gpt_oss'\n"
              "def loads_natively():\n    return bool(HPU_MXFP4_NATIVE)\n")
    exec(compile(source, "gptoss_mxfp4.py", "exec"), module.__dict__)
    return module


def test_the_installed_plugin_registers_its_keeper() -> None:
    keepers = collect_keepers(quantreg.Registry.build(env={}))
    (mine,) = [k for k in keepers if k.plugin == "hpu_mxfp4"]
    assert (mine.quant_method, mine.quant_format, mine.model_type) == ("mxfp4", "gpt_oss_mxfp4", "gpt_oss")
    assert mine.module == "vllm_gaudi.models.gptoss_mxfp4"
    assert quantreg.methods.load_object(mine.target) is keep_native


@pytest.mark.parametrize("table_keeps", [True, False])
def test_one_switch_drives_both_readers_from_the_table(table_keeps: bool) -> None:
    module = gaudi_module(native=False)
    asked: list[int] = []

    def should_keep() -> bool:
        asked.append(1)
        return table_keeps

    undo = keep_native(module, should_keep)
    assert not asked  # nothing decided when attaching: the device and table are read later
    assert module.strips("gpt_oss") is (not table_keeps)  # the quant-config strip ...
    assert module.loads_natively() is table_keeps  # ... and the loader agree
    assert module.strips("llama") is False
    assert len(asked) >= 2  # asked each time vllm-gaudi reads its switch
    assert keep_native(module, lambda: True)() is None  # attaching twice changes nothing
    assert module.loads_natively() is table_keeps
    undo()
    assert module.HPU_MXFP4_NATIVE is False


def test_operator_flag_keeps_its_meaning() -> None:
    module = gaudi_module(native=True)
    keep_native(module, lambda: False)
    assert module.loads_natively() and not module.strips("gpt_oss")
    switch = module.HPU_MXFP4_NATIVE
    assert isinstance(switch, TableSwitch) and switch == True and int(switch) == 1  # noqa: E712


def test_a_vllm_gaudi_without_the_switch_is_reported() -> None:
    with pytest.raises(AttributeError, match="has no HPU_MXFP4_NATIVE"):
        keep_native(types.ModuleType(vllm_gaudi.MODULE), lambda: True)


def _registry(tmp_path: Path, method: str | None) -> quantreg.Registry:
    if method is None:
        return quantreg.Registry.build(env={})
    table = tmp_path / "t.yaml"
    table.write_text("version: 1\nrules:\n  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}\n"
                     f"    method: {method}\n")
    return quantreg.Registry.build(config=[table], env={})


@pytest.mark.needs("torch", "vllm")  # the table's mxfp4_reference is chosen only where it can run
def test_findings_when_the_table_keeps_the_config(tmp_path: Path) -> None:
    (finding,) = findings(_registry(tmp_path, "mxfp4_reference").resolve, "cpu", env={}, vllm_gaudi_installed=True)
    assert finding.level == "info" and finding.key == ("gpt_oss_mxfp4", "gpt_oss", "cpu")
    assert finding.message == ("HPU_MXFP4_NATIVE is unset but the table chose 'mxfp4_reference' "
                               f"[{tmp_path}/t.yaml:3]: quantreg keeps the MXFP4 quant config and vllm-gaudi "
                               "loads the packed weights (its native loader)")


def test_findings_when_vllm_gaudi_strips(tmp_path: Path) -> None:
    (finding,) = findings(_registry(tmp_path, None).resolve, "hpu",
                          env={"HPU_MXFP4_NATIVE": "0"}, vllm_gaudi_installed=True)
    assert finding.level == "warning" and finding.key == ("gpt_oss_mxfp4", "gpt_oss", "hpu")
    rules = Path(vllm_gaudi.__file__).with_name("rules.yaml")
    assert finding.message.startswith(  # the plugin's rule fell back to vllm: no Gaudi stack here
        f"vllm-gaudi strips the MXFP4 quant config (HPU_MXFP4_NATIVE is 0 and the table says vllm [{rules}:5]; "
        "no method in the chain is available here; vLLM keeps its own method) and dequantises")
    assert finding.message.endswith("arrive as (unquantized, gpt_oss, hpu) -> vllm "
                                    f"[{Path(quantreg.__file__).parent / 'registry.yaml'}:5]")


def test_findings_when_the_operator_set_the_flag(tmp_path: Path) -> None:
    (finding,) = findings(_registry(tmp_path, None).resolve, "cpu",
                          env={"HPU_MXFP4_NATIVE": "1"}, vllm_gaudi_installed=True)
    assert finding.level == "info" and "(HPU_MXFP4_NATIVE=1)" in finding.message
    assert findings(_registry(tmp_path, None).resolve, "cpu", env={}, vllm_gaudi_installed=False) == []


@pytest.fixture
def fake_vllm_gaudi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An importable (not imported) ``vllm_gaudi`` package, so ``find_spec`` sees it."""
    (tmp_path / "site" / "vllm_gaudi").mkdir(parents=True)
    (tmp_path / "site" / "vllm_gaudi" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delenv("HPU_MXFP4_NATIVE", raising=False)
    yield
    sys.modules.pop("vllm_gaudi", None)


@pytest.mark.needs("torch", "vllm")  # as above: the finding is about mxfp4_reference, chosen
def test_doctor_hook_speaks_only_where_vllm_gaudi_is(fake_vllm_gaudi: None, tmp_path: Path) -> None:
    registry = _registry(tmp_path, "mxfp4_reference")
    mine = [f for f in registry.findings("cpu") if f.plugin == "hpu_mxfp4"]
    assert [(f.level, f.key) for f in mine] == [("info", ("gpt_oss_mxfp4", "gpt_oss", "cpu"))]
    assert "quantreg keeps the MXFP4 quant config" in mine[0].message
    hpu = [f for f in registry.findings("hpu") if f.plugin == "hpu_mxfp4"]
    assert [f.level for f in hpu] == ["warning"]  # the user rule names cpu; on hpu the plugin rule falls back here
