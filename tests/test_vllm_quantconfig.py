"""Quant-config keepers (hook ``register_quant_config_keepers``) and plugin doctor findings (``doctor_findings``).

Real parts: plugins are installed distributions (``PluginSite``), the "third party that strips a
quant config" is a real module imported through ``sys.meta_path`` (so the post-import hook is the
one vLLM processes use), tables are YAML files. Only the device is injected (vLLM is not needed
to answer "what would the table decide here").
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from core_support import PluginSite

import quantreg
from quantreg import Decision, Finding, Key
from quantreg.keepers import QuantConfigKeeper, keeper_problem
from quantreg.registry import Registry
from quantreg.vllm.quantconfig import QuantConfigGuard, collect_keepers

pytestmark = pytest.mark.usefixtures("clean_env")

THIRD_PARTY = '''
SWITCH = False          # read once from the environment by the real thing
READS = []

def keeps(model_type):
    """Like vllm-gaudi's patch: reads its switch when it runs."""
    READS.append(model_type)
    return bool(SWITCH) or model_type != "gpt_oss"
'''


def hooks(module: str, keeper: str, method_attr: str) -> str:
    """A test plugin module's two hooks: method ``qrt_method`` (``module:method_attr``) and the keeper
    ``keeper`` (``module:keep``) of the gpt_oss MXFP4 quant config, attached to ``qrt_third_party``."""
    return f'''
@quantreg.hookimpl
def register_methods(register):
    register(quantreg.Method(name="qrt_method", target="{module}:{method_attr}"))

@quantreg.hookimpl
def register_quant_config_keepers(register):
    register(QuantConfigKeeper(name="{keeper}", quant_method="mxfp4", quant_format="gpt_oss_mxfp4",
                               model_type="gpt_oss", module="qrt_third_party", target="{module}:keep"))
'''


KEEPER_PLUGIN = '''
import quantreg
from quantreg.keepers import QuantConfigKeeper

CALLS = []

class Method:
    pass

def keep(module, should_keep):
    CALLS.append(module.__name__)
    previous = module.SWITCH

    class Switch:
        def __bool__(self):
            return previous or should_keep()

    module.SWITCH = Switch()

    def undo():
        module.SWITCH = previous

    return undo
''' + hooks("qrt_keeper_plugin", "qrt_keeper", "Method")


@pytest.fixture
def keeper_site(plugin_site: PluginSite, module_dir: Callable[[str, str], Path]) -> PluginSite:
    plugin_site.add("qrt-keeper", {"keeper": "qrt_keeper_plugin"}, modules={"qrt_keeper_plugin": KEEPER_PLUGIN})
    module_dir("qrt_third_party", THIRD_PARTY)
    return plugin_site


@pytest.fixture
def guard() -> Iterator[Callable[[Registry, str], QuantConfigGuard]]:
    made: list[QuantConfigGuard] = []

    def make(registry: Registry, device: str = "cpu") -> QuantConfigGuard:
        g = QuantConfigGuard(device=lambda: device, registry=lambda: registry)
        made.append(g)
        return g

    yield make
    for g in made:
        g.disarm()


def _table(tmp_path: Path, method: str) -> Path:
    path = tmp_path / f"{method}.yaml"
    path.write_text("version: 1\nrules:\n  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}\n"
                    f"    method: {method}\n")
    return path


@pytest.mark.parametrize("import_first", [False, True], ids=["quantreg-first", "third-party-first"])
def test_table_choosing_a_method_keeps_the_config_in_either_order(
        keeper_site: PluginSite, tmp_path: Path, guard: Callable[..., QuantConfigGuard], import_first: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    registry = Registry.build(config=[_table(tmp_path, "qrt_method")])
    if import_first:
        third = importlib.import_module("qrt_third_party")
    g = guard(registry)
    g.arm(registry)
    if not import_first:
        assert "qrt_third_party" not in sys.modules  # nothing imported by arming
        third = importlib.import_module("qrt_third_party")
    plugin = sys.modules["qrt_keeper_plugin"]
    assert plugin.CALLS == ["qrt_third_party"]  # attached exactly once, right after the import
    with caplog.at_level(logging.INFO, logger="vllm.quantreg"):
        assert third.keeps("gpt_oss") is True  # the switch now follows the table
    assert f"quantreg: (gpt_oss_mxfp4, gpt_oss, cpu): the table chose 'qrt_method' [{tmp_path}/qrt_method.yaml:3]" \
        in caplog.text
    g.disarm()
    assert third.SWITCH is False and third.keeps("gpt_oss") is False  # undone


def test_table_saying_vllm_leaves_the_third_party_alone(keeper_site: PluginSite, tmp_path: Path,
                                                         guard: Callable[..., QuantConfigGuard]) -> None:
    registry = Registry.build(config=[_table(tmp_path, "vllm")])
    guard(registry).arm(registry)
    third = importlib.import_module("qrt_third_party")
    assert third.keeps("gpt_oss") is False  # stripped, as without quantreg
    assert third.keeps("llama") is True


def test_decision_is_per_device_and_read_when_the_switch_is_read(
        keeper_site: PluginSite, tmp_path: Path, guard: Callable[..., QuantConfigGuard]) -> None:
    """The rule names device cpu: on another device the key differs, so the default (vllm) applies."""
    registry = Registry.build(config=[_table(tmp_path, "qrt_method")])
    device = {"now": "hpu"}
    g = QuantConfigGuard(device=lambda: device["now"], registry=lambda: registry)
    try:
        g.arm(registry)
        third = importlib.import_module("qrt_third_party")
        assert third.keeps("gpt_oss") is False
        device["now"] = "cpu"
        assert third.keeps("gpt_oss") is True  # nothing was cached at attach time
    finally:
        g.disarm()


def test_broken_keeper_target_is_logged_and_the_third_party_acts_alone(
        plugin_site: PluginSite, module_dir: Callable[[str, str], Path], tmp_path: Path,
        guard: Callable[..., QuantConfigGuard], caplog: pytest.LogCaptureFixture) -> None:
    plugin_site.add("qrt-broken", {"broken": "qrt_broken_keeper"}, modules={"qrt_broken_keeper": '''
import quantreg
from quantreg.keepers import QuantConfigKeeper

def keep(module, should_keep):
    raise RuntimeError("cannot find the switch")

@quantreg.hookimpl
def register_quant_config_keepers(register):
    register(QuantConfigKeeper(name="k", quant_method="mxfp4", quant_format="f", model_type="gpt_oss",
                               module="qrt_third_party", target="qrt_broken_keeper:keep"))
    register("not a keeper")
'''})
    module_dir("qrt_third_party", THIRD_PARTY)
    registry = Registry.build()
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg"):
        guard(registry).arm(registry)
        third = importlib.import_module("qrt_third_party")
    assert third.keeps("gpt_oss") is False
    assert "quant-config keeper 'k' of plugin 'broken' failed on qrt_third_party: RuntimeError: cannot find the " \
        "switch" in caplog.text
    assert "register() expects a quantreg.QuantConfigKeeper, got str" in caplog.text
    assert any(f.hook == "register_quant_config_keepers" for f in registry.failures)


def test_keeper_fields_are_checked() -> None:
    good = QuantConfigKeeper("k", "mxfp4", "gpt_oss_mxfp4", "gpt_oss", "pkg.mod", "pkg.mod:fn")
    assert keeper_problem(good) is None
    assert "module 'pkg..mod'" in str(keeper_problem(QuantConfigKeeper("k", "m", "f", "t", "pkg..mod", "a:b")))
    assert "target 'pkg.mod.fn'" in str(keeper_problem(QuantConfigKeeper("k", "m", "f", "t", "pkg", "pkg.mod.fn")))
    assert "field quant_format" in str(keeper_problem(QuantConfigKeeper("k", "m", "", "t", "pkg", "a:b")))
    assert good.matches("gpt_oss", "MXFP4") and not good.matches("llama", "mxfp4") and not good.matches("gpt_oss", None)


class _DuplicateKeepers:
    @quantreg.hookimpl
    def register_quant_config_keepers(self, register: Callable[[Any], None]) -> None:
        keeper = QuantConfigKeeper("same", "mxfp4", "gpt_oss_mxfp4", "gpt_oss", "pkg.mod", "pkg.mod:fn")
        register(keeper)
        register(keeper)


def test_duplicate_keeper_names_keep_the_first() -> None:
    registry = Registry.build(entry_points=False, plugins=[("dup", _DuplicateKeepers())])
    keepers = collect_keepers(registry)
    assert [(k.name, k.plugin) for k in keepers] == [("same", "dup")]
    assert "keeper 'same' is already registered by plugin 'dup'" in str(registry.failures[-1])


class _Findings:
    @quantreg.hookimpl
    def doctor_findings(self, register: Callable[[Finding], None], resolve: Callable[[Key], Decision],
                        device: str | None) -> None:
        decision = resolve(Key("gpt_oss_mxfp4", "gpt_oss", device or "cpu"))
        register(Finding("warning", f"the table says {decision.method} here", decision.key))
        register(Finding("loud", "bad level"))
        register("not a finding")


class _OnlyRegister:
    @quantreg.hookimpl
    def doctor_findings(self, register: Callable[[Finding], None]) -> None:
        register(Finding("info", "takes only register"))


class _Raising:
    @quantreg.hookimpl
    def doctor_findings(self, register: Callable[[Finding], None]) -> None:
        register(Finding("info", "never seen"))
        raise OSError("no such device")


def test_doctor_findings_are_attributed_and_faults_isolated() -> None:
    registry = Registry.build(entry_points=False, plugins=[("a", _Findings()), ("b", _Raising()),
                                                           ("c", _OnlyRegister())])
    found = list(registry.findings("hpu"))
    assert [(f.level, f.plugin, f.message) for f in found] == [
        ("warning", "a", "the table says vllm here"),
        ("error", "a",
         "hook doctor_findings registered level 'loud' (expected one of info, warning, error): bad level"),
        ("error", "a", "hook doctor_findings register() expects a quantreg.Finding, got str"),
        ("error", "b", "hook doctor_findings raised OSError: no such device"),
        ("info", "c", "takes only register"),
    ]
    assert str(found[0]) == "(gpt_oss_mxfp4, gpt_oss, hpu): the table says vllm here [plugin a]"
    assert found[0].as_json()["key"] == ["gpt_oss_mxfp4", "gpt_oss", "hpu"]


def test_config_stripped_despite_the_table_is_reported(
        plugin_site: PluginSite, module_dir: Callable[[str, str], Path], tmp_path: Path,
        guard: Callable[..., QuantConfigGuard], caplog: pytest.LogCaptureFixture) -> None:
    """A keeper that attaches but no longer reaches the switch: vLLM's convertor check says so."""
    pytest.importorskip("vllm")
    plugin_site.add("qrt-stale", {"stale": "qrt_stale_keeper"}, modules={"qrt_stale_keeper": '''
import quantreg
from quantreg.keepers import QuantConfigKeeper

def keep(module, should_keep):
    return None  # a third party that changed: the switch it reads is no longer this one
''' + hooks("qrt_stale_keeper", "stale", "keep")})
    module_dir("qrt_third_party", THIRD_PARTY)
    import vllm.config  # noqa: F401  (imports the convertor module the way vLLM does; alone it is circular)
    from vllm.transformers_utils import model_arch_config_convertor as convertor

    original = convertor.ModelArchConfigConvertorBase.get_quantization_config
    registry = Registry.build(config=[_table(tmp_path, "qrt_method")])
    g = guard(registry)
    g.arm(registry)
    importlib.import_module("qrt_third_party")  # attaches the keeper, then arms the convertor check
    assert convertor.ModelArchConfigConvertorBase.get_quantization_config is not original
    hf_config = types.SimpleNamespace(model_type="gpt_oss", quantization_config={"quant_method": "mxfp4"})
    stripped = types.SimpleNamespace(hf_config=hf_config, _normalize_quantization_config=lambda config: None)
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg"):
        assert convertor.ModelArchConfigConvertorBase.get_quantization_config(stripped) is None
    assert ("the table asked to keep the mxfp4 quant config of this gpt_oss checkpoint, but something still "
            "stripped it") in caplog.text
    assert "rule for (gpt_oss_mxfp4, gpt_oss, cpu) cannot apply" in caplog.text
    caplog.clear()
    kept = types.SimpleNamespace(hf_config=hf_config, _normalize_quantization_config=lambda config: {"x": 1})
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg"):
        assert convertor.ModelArchConfigConvertorBase.get_quantization_config(kept) == {"x": 1}
    assert "stripped" not in caplog.text
    g.disarm()
    assert convertor.ModelArchConfigConvertorBase.get_quantization_config is original
