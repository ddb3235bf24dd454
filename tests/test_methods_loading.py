"""Methods: laziness and loading. Targets and probes are imported only when a decision needs them;
load errors, the base class the seam passes, the construction contract, and the vLLM version checks
(``version_satisfies``, ``check_specifier``, the installed version read without importing vLLM)."""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
from registry_support import build, rules_yaml

from quantreg import Key, Method
from quantreg.installed import installed_vllm_version, module_available
from quantreg.methods import BuildContext, load_object, version_satisfies
from quantreg.version_spec import check_specifier

pytestmark = pytest.mark.usefixtures("clean_env")


# -- methods: laziness and loading ------------------------------------------------------------
@pytest.mark.usefixtures("vllm_not_loaded")
def test_targets_and_probes_are_imported_only_when_needed(table: Callable[[str, str], Path],
                                                          module_dir: Callable[[str, str], Path]) -> None:
    module_dir("qrt_lazy_target", "class Fast:\n    pass\n")
    module_dir("qrt_lazy_probe", "def ok():\n    return True, 'fine'\n")
    module_dir("qrt_lazy_other_probe", "def ok():\n    return True, 'fine'\n")
    methods = [Method("fast", "qrt_lazy_target:Fast", probe="qrt_lazy_probe:ok"),
               Method("spare", "qrt_lazy_target:Fast", probe="qrt_lazy_other_probe:ok")]
    user = table("user.yaml", rules_yaml("{match: {device: cpu}, method: [fast, spare]}"))
    registry = build(methods=methods, user=[user])
    lazy = {"qrt_lazy_target", "qrt_lazy_probe", "qrt_lazy_other_probe"}
    assert lazy.isdisjoint(sys.modules)  # building the registry imports nothing
    registry.resolve(("q", "m", "hpu"))  # not matched by the rule: nothing probed
    assert lazy.isdisjoint(sys.modules)
    assert registry.resolve(("q", "m", "cpu")).method == "fast"
    assert "qrt_lazy_probe" in sys.modules  # probed
    assert "qrt_lazy_other_probe" not in sys.modules  # never tried
    assert "qrt_lazy_target" not in sys.modules  # chosen, but not built yet
    cls = registry.methods["fast"].load()
    assert "qrt_lazy_target" in sys.modules and cls.__name__ == "Fast"


def test_method_load_errors(module_dir: Callable[[str, str], Path]) -> None:
    module_dir("qrt_target", "class Target:\n    pass\n\n\ndef not_a_class():\n    pass\n")
    with pytest.raises(TypeError, match=r"target qrt_target:not_a_class is a function, not a class"):
        Method("m", "qrt_target:not_a_class").load()
    with pytest.raises(ImportError, match=r"module 'qrt_target' has no attribute 'Nope' \(target qrt_target:Nope\)"):
        Method("m", "qrt_target:Nope").load()
    with pytest.raises(ModuleNotFoundError):
        Method("m", "qrt_missing_module:X").load()
    with pytest.raises(ValueError, match=r"is not of the form 'package\.module:Name'"):
        load_object("qrt_target.Target")
    assert load_object("os.path:join") is os.path.join


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> type:
    """A stand-in ``vllm`` in sys.modules (never the real one: importing it takes seconds)."""
    base = type("FusedMoEMethodBase", (), {})
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.32.0+cpu"  # type: ignore[attr-defined]
    fused_moe = types.ModuleType("vllm.model_executor.layers.fused_moe")
    fused_moe.FusedMoEMethodBase = base  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.fused_moe", fused_moe)
    return base


def test_loaded_target_must_subclass_the_base_the_seam_passes(fake_vllm: type,
                                                              module_dir: Callable[[str, str], Path]) -> None:
    """The seam passes vLLM's base (:mod:`quantreg.vllm.platform`, here the stand-in's) into
    ``load``/``build``; the core checks against it and imports nothing of vLLM itself (issue 47)."""
    from quantreg.vllm.platform import fused_moe_method_base

    base = fused_moe_method_base()
    assert base is fake_vllm
    module_dir("qrt_methods", """
import sys

Base = sys.modules["vllm.model_executor.layers.fused_moe"].FusedMoEMethodBase


class Good(Base):
    pass


class Stray:
    pass
""")
    assert Method("good", "qrt_methods:Good").load(base=base).__name__ == "Good"
    with pytest.raises(TypeError, match="does not subclass vLLM's FusedMoEMethodBase"):
        Method("stray", "qrt_methods:Stray").load(base=base)
    with pytest.raises(TypeError, match="does not subclass vLLM's FusedMoEMethodBase"):
        Method("stray", "qrt_methods:Stray").build(None, BuildContext(Key("f", "m", "cpu"), "stray", "t:1"), base=base)
    assert Method("stray", "qrt_methods:Stray").load().__name__ == "Stray"  # no base given: no class check


@pytest.mark.usefixtures("vllm_not_loaded")
def test_without_vllm_loaded_any_class_is_accepted(module_dir: Callable[[str, str], Path]) -> None:
    module_dir("qrt_target", "class Target:\n    pass\n")
    assert Method("m", "qrt_target:Target").load().__name__ == "Target"
    assert "vllm" not in sys.modules


CONSTRUCTION_MODULE = """
class Plain:  # the original contract: cls(moe_config, **options)
    def __init__(self, moe, **options):
        self.moe, self.options = moe, options


class WithContext:  # opts in by naming the keyword
    def __init__(self, moe, quantreg_context=None, *, alpha=1.0):
        self.moe, self.context, self.alpha = moe, quantreg_context, alpha


class KeywordOnly:
    def __init__(self, moe, *, quantreg_context, **options):
        self.context, self.options = quantreg_context, options
"""


@pytest.mark.usefixtures("vllm_not_loaded")
def test_construction_contract_old_and_new_form(module_dir: Callable[[str, str], Path]) -> None:
    """Plain classes get ``cls(moe_config, **options)``; classes naming ``quantreg_context`` get the context too."""
    from quantreg.methods import BuildContext, wants_context

    module_dir("qrt_build", CONSTRUCTION_MODULE)
    layer = object()
    context = BuildContext(Key("gpt_oss_mxfp4", "gpt_oss", "cpu"), "m", "user.yaml:4", {"alpha": 1.5},
                           "model.layers.0.mlp.experts", layer)
    moe = object()
    plain = Method("m", "qrt_build:Plain").build(moe, context)
    assert plain.moe is moe and plain.options == {"alpha": 1.5}  # a **options catch-all never sees the context
    new = Method("m", "qrt_build:WithContext").build(moe, context)
    assert new.moe is moe and new.alpha == 1.5 and new.context is context
    assert (new.context.key.model_type, new.context.rule, new.context.prefix) == (
        "gpt_oss", "user.yaml:4", "model.layers.0.mlp.experts")
    assert new.context.layer is layer and dict(new.context.options) == {"alpha": 1.5}
    keyword_only = Method("m", "qrt_build:KeywordOnly").build(moe, context)
    assert keyword_only.context is context and keyword_only.options == {"alpha": 1.5}
    assert [wants_context(c) for c in (dict, int)] == [False, False]  # builtins: the plain form


def test_vllm_version_requirement(fake_vllm: type) -> None:
    assert installed_vllm_version() == "0.32.0+cpu"
    assert Method("m", "x:Y", vllm_version=">=0.30,<0.40").availability("cpu").ok
    avail = Method("m", "x:Y", vllm_version=">=0.33").availability("cpu")
    assert (avail.ok, avail.reason) == (False, "requires vLLM >=0.33; installed is 0.32.0+cpu")


@pytest.mark.usefixtures("vllm_not_loaded")
def test_installed_vllm_version_without_importing_vllm() -> None:
    from quantreg.installed import vllm_distribution

    dist = vllm_distribution()
    assert installed_vllm_version() == (dist[1] if dist else None)
    assert "vllm" not in sys.modules


@pytest.mark.parametrize(
    ("version", "spec", "ok"),
    [
        ("0.32.0", ">=0.30,<0.40", True),
        ("0.32.0+cpu", ">=0.32", True),
        ("0.32", "==0.32.0", True),
        ("0.32.1", "==0.32", False),
        ("0.40.0", ">=0.30,<0.40", False),
        ("0.29.9", ">0.29.8, <=0.29.9", True),
        ("1.0.0", "!=1.0", False),
        ("0.32.0", "~=0.32", False),
    ],
)
def test_version_satisfies(version: str, spec: str, ok: bool) -> None:
    assert version_satisfies(version, spec) is ok


def test_check_specifier() -> None:
    assert check_specifier(">=0.30, <0.40") is None
    assert check_specifier(">=0.30,,<0.40") == "cannot read version clause ''; expected e.g. '>=0.30,<0.40'"
    assert check_specifier("0.30") is not None


def test_module_available_does_not_import() -> None:
    assert module_available("json")
    assert not module_available("qrt_definitely_missing_module")
    assert not module_available("qrt_definitely_missing_module.sub")
    assert not module_available("")


def test_method_devices_and_vllm_is_always_available() -> None:
    m = Method("m", "x:Y", devices=("cpu", "hpu"))
    assert m.runs_on("cpu") and not m.runs_on("cuda")
    assert Method("m", "x:Y").runs_on("anything")
    assert Method("vllm", "x:Y", devices=("none",)).availability("cpu").ok
