"""scripts/vllm_compat_check.py: reads a vLLM release's sources (a directory or a wheel) without importing them.

Two kinds of input: the vLLM installed in this environment (every symbol quantreg relies on must
be present: it is the release the whole suite runs on), and a small synthetic ``vllm`` tree
written here with exactly one fault of each kind (a missing symbol, a changed signature, a
seam override without ``super()``), as a directory and zipped as a wheel.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from quantreg.installed import installed_vllm_version

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "vllm_compat_check.py"
SEAM = "vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts._get_quant_method"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_compat_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


check = load_script()


def installed_vllm_dir() -> Path:
    spec = importlib.util.find_spec("vllm")  # a top-level find_spec imports nothing
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations)))


def by_symbol(report: object) -> dict[str, dict[str, object]]:
    return {str(s["symbol"]) + ("#abstract" if s["kind"] == "abstract" else ""): s
            for s in report.symbols}  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# The installed vLLM
# ---------------------------------------------------------------------------------------------


def test_installed_vllm_has_every_required_symbol() -> None:
    target = installed_vllm_dir()
    report = check.check(target)
    assert report.failures == [], report.text()
    statuses = by_symbol(report)
    assert statuses[SEAM]["status"] == "present"
    assert str(statuses[SEAM]["where"]).startswith("vllm/model_executor/layers/fused_moe/routed_experts.py:")
    assert len(report.symbols) == len(check.SYMBOLS)
    # the version read from the dist-info beside the package is the one importlib.metadata reports
    assert report.version is not None and report.version == installed_vllm_version()
    for override in report.overrides:  # whatever this release has, each names a real class and line
        assert override["where"].startswith("vllm/") and override["class"]


def test_command_line_imports_no_vllm_and_prints_json() -> None:
    target = installed_vllm_dir()
    code = ("import runpy, sys; sys.argv = ['vllm_compat_check', sys.argv[1], '--json'];\n"
            f"try:\n    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
            "except SystemExit as exc:\n    code = exc.code\n"
            "assert not [m for m in sys.modules if m == 'vllm' or m.startswith(('vllm.', 'torch'))], 'imported'\n"
            "sys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["ok"] is True and data["counts"]["changed"] == 0
    assert {s["symbol"] for s in data["symbols"]} >= {SEAM, "vllm.config.get_current_vllm_config_or_none"}


# ---------------------------------------------------------------------------------------------
# A synthetic release with one fault of each kind
# ---------------------------------------------------------------------------------------------

SYNTHETIC = {
    "vllm/__init__.py": """
        MODULE_ATTRS = {"LLM": ".entrypoints.llm:LLM"}
        def __getattr__(name):
            raise AttributeError(name)
    """,
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/llm.py": "class LLM:\n    def __init__(self, model, **kwargs): ...\n",
    "vllm/_version.py": "__version__ = version = '9.9.0'\n",
    "vllm/config/__init__.py": "from vllm.config.vllm import VllmConfig, set_current_vllm_config\n",
    "vllm/config/vllm.py": """
        class VllmConfig:
            model_config: object = None
        def set_current_vllm_config(vllm_config, check_compile=False): ...
    """,  # no get_current_vllm_config_or_none, no additional_config: missing
    "vllm/platforms/__init__.py": """
        def __getattr__(name):
            if name == "current_platform":
                return object()
            raise AttributeError(name)
    """,
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/layers/__init__.py": "",
    "vllm/model_executor/layers/fused_moe/__init__.py": "",
    "vllm/model_executor/layers/fused_moe/routed_experts.py": """
        class RoutedExperts:
            def __init__(self, moe_config):
                self.moe_config = moe_config
                self.local_num_experts = 1
            def _get_quant_method(self, prefix, quant_config, moe_config, layer_index):
                return None
    """,  # the seam got a new required parameter: changed
    "vllm/model_executor/layers/fused_moe/fused_moe_method_base.py": """
        from abc import abstractmethod
        class FusedMoEMethodBase:
            def __init__(self, moe): ...
            @abstractmethod
            def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                               params_dtype, **extra): ...
            @abstractmethod
            def get_fused_moe_quant_config(self, layer): ...
            @abstractmethod
            def apply_sharded(self, layer, x): ...
            def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input, extra): ...
    """,  # a new abstract method and one more argument vLLM passes to apply: both changed
    "vllm/models/__init__.py": "",
    "vllm/models/spark/__init__.py": "",
    "vllm/models/spark/base.py": """
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
        class SparkConsolidated(RoutedExperts):
            pass
    """,
    "vllm/models/spark/runner.py": """
        from .base import SparkConsolidated
        from vllm.model_executor.layers.fused_moe import routed_experts as re_mod
        class SparkRoutedExperts(SparkConsolidated):
            def _get_quant_method(self, prefix, quant_config, moe_config):
                return quant_config.get_quant_method(self, prefix)
        class PoliteExperts(re_mod.RoutedExperts):
            def _get_quant_method(self, prefix, quant_config, moe_config):
                method = super()._get_quant_method(prefix, quant_config, moe_config)
                return method
        class NotAnExpertLayer:
            def _get_quant_method(self):
                return None
    """,
}


@pytest.fixture
def synthetic(tmp_path: Path) -> Path:
    root = tmp_path / "site"
    for rel, text in SYNTHETIC.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def assert_synthetic_report(report: object) -> None:
    statuses = by_symbol(report)
    seam = statuses[SEAM]
    assert seam["status"] == "changed"
    assert "new required parameter(s) layer_index" in str(seam["detail"])
    assert statuses["vllm.config.get_current_vllm_config_or_none"]["status"] == "missing"
    assert statuses["vllm.config.VllmConfig.additional_config"]["status"] == "missing"
    assert statuses["vllm.config.set_current_vllm_config"]["status"] == "present"  # re-exported, signature fits
    assert statuses["vllm.platforms.current_platform"]["status"] == "present"  # lazy __getattr__
    assert statuses["vllm.LLM"]["status"] == "present"  # MODULE_ATTRS lazy export
    assert statuses["vllm.LLM"]["where"] == "vllm/entrypoints/llm.py:1"
    abstract = statuses["vllm.model_executor.layers.fused_moe.fused_moe_method_base.FusedMoEMethodBase#abstract"]
    assert abstract["status"] == "changed" and "apply_sharded" in str(abstract["detail"])
    apply = statuses["vllm.model_executor.layers.fused_moe.fused_moe_method_base.FusedMoEMethodBase.apply"]
    assert apply["status"] == "changed" and "extra" in str(apply["detail"])
    assert statuses["vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts.local_num_experts"][
        "status"] == "present"  # a self.x assignment in __init__
    assert statuses["vllm.plugins.vllm.general_plugins"]["status"] == "missing"  # no module at all
    overrides = {o["class"]: o for o in report.overrides}  # type: ignore[attr-defined]
    assert set(overrides) == {"SparkRoutedExperts", "PoliteExperts"}  # NotAnExpertLayer is no RoutedExperts
    assert overrides["SparkRoutedExperts"]["calls_super"] is False  # through a base in another module
    assert overrides["SparkRoutedExperts"]["where"] == "vllm/models/spark/runner.py:4"
    assert overrides["PoliteExperts"]["calls_super"] is True
    assert [o["class"] for o in report.bypasses] == ["SparkRoutedExperts"]  # type: ignore[attr-defined]
    assert report.version == "9.9.0"  # type: ignore[attr-defined]


def test_synthetic_tree_reports_missing_changed_and_bypass(synthetic: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert_synthetic_report(check.check(synthetic))
    assert_synthetic_report(check.check(synthetic / "vllm"))  # the package directory itself works too
    assert check.main([str(synthetic)]) == 1
    out = capsys.readouterr().out
    assert "WITHOUT super(): the seam never sees these layers" in out
    assert "SparkRoutedExperts (SparkConsolidated) at vllm/models/spark/runner.py:4" in out


def test_wheel_is_read_as_a_zip(synthetic: Path, tmp_path: Path) -> None:
    wheel = tmp_path / "vllm-9.9.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path in sorted((synthetic / "vllm").rglob("*.py")):
            zf.write(path, path.relative_to(synthetic).as_posix())
        zf.writestr("vllm-9.9.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.1\n")
    report = check.check(wheel)
    assert report.version == "9.9.1"  # METADATA wins over _version.py
    report.version = "9.9.0"
    assert_synthetic_report(report)


def test_bypass_alone_fails_only_when_asked(synthetic: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A release whose symbols all fit but that has an override without super(): exit 0, or 1 with the flag."""
    target = installed_vllm_dir()
    site = synthetic.parent / "installed-plus-bypass"

    def sources_only(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if n == "__pycache__" or not (n.endswith(".py") or (Path(folder) / n).is_dir())]

    shutil.copytree(target, site / "vllm", ignore=sources_only)
    (site / "vllm" / "models" / "bypass_model.py").write_text(
        "from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts\n"
        "class BypassExperts(RoutedExperts):\n"
        "    def _get_quant_method(self, prefix, quant_config, moe_config):\n"
        "        return None\n")
    assert check.main([str(site)]) == 0
    assert check.main([str(site), "--fail-on-bypass"]) == 1
    assert "override BypassExperts (RoutedExperts) at vllm/models/bypass_model.py:2" in capsys.readouterr().out


def test_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert check.main([str(tmp_path / "nope")]) == 2
    assert check.main([str(tmp_path)]) == 2
    assert "no vllm/__init__.py here" in capsys.readouterr().err


FACTORY = "vllm.model_executor.layers.fused_moe.layer.FusedMoEFactory"


def test_pre_rename_factory_counts_as_present(tmp_path: Path) -> None:
    """vLLM 0.26 builds MoE layers with ``FusedMoE`` (same function, before the ``FusedMoEFactory``
    rename): the check finds it under that name, checks its keywords there, and counts it as present;
    with neither name it is missing and says both."""
    target = installed_vllm_dir()

    def sources_only(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if n == "__pycache__" or not (n.endswith(".py") or (Path(folder) / n).is_dir())]

    site = tmp_path / "v026-like"
    shutil.copytree(target, site / "vllm", ignore=sources_only)
    layer = site / "vllm" / "model_executor" / "layers" / "fused_moe" / "layer.py"
    text = layer.read_text()
    assert "def FusedMoEFactory(" in text
    layer.write_text(text.replace("FusedMoEFactory", "FusedMoE"))
    entry = by_symbol(check.check(site))[FACTORY]
    assert entry["status"] == "present" and entry["found_as"] == "FusedMoE", entry
    assert "(as FusedMoE, a name quantreg also takes)" in str(entry["where"])
    assert check.main([str(site)]) == 0
    layer.write_text(text.replace("FusedMoEFactory", "BuildMoE"))
    entry = by_symbol(check.check(site))[FACTORY]
    assert entry["status"] == "missing" and "nor FusedMoE" in str(entry["detail"])


def test_kit_takes_either_factory_name_or_says_what_it_needs() -> None:
    """The kit's harness asks :func:`moe_factory_v0_26` for the factory: 0.28+'s name, 0.26's, or one clear error."""
    from types import SimpleNamespace

    from quantreg.vllm.versions import moe_factory_v0_26

    def new() -> None: ...

    def old() -> None: ...

    assert moe_factory_v0_26(SimpleNamespace(FusedMoEFactory=new, FusedMoE=old)) is new
    assert moe_factory_v0_26(SimpleNamespace(FusedMoE=old)) is old
    with pytest.raises(RuntimeError, match=r"has neither FusedMoEFactory nor FusedMoE in fused_moe\.layer.*"
                                           r"the seam and register\(\) do not need it"):
        moe_factory_v0_26(SimpleNamespace(__name__="fused_moe.layer"))
