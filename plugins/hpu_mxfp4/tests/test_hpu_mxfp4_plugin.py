"""The plugin as installed: its entry point, hooks, table and the decisions they produce here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from quantreg_hpu_mxfp4 import plugin

import quantreg
from quantreg.testing.packaging import installed_entry_point

KEY = ("gpt_oss_mxfp4", "gpt_oss", "hpu")


def test_entry_point_is_installed() -> None:
    installed_entry_point("hpu_mxfp4", plugin, "quantreg-hpu-mxfp4")  # the kit: one, of this dist, loads plugin


def test_importing_the_plugin_pulls_in_neither_torch_nor_vllm() -> None:
    code = ("import sys, quantreg_hpu_mxfp4.plugin, quantreg; quantreg.Registry.build().resolve("
            f"{KEY!r}); bad = {{'torch', 'vllm'}} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


NO_GAUDI = pytest.mark.skipif(importlib.util.find_spec("habana_frameworks") is not None,
                              reason="expects a machine without the Gaudi stack")


@NO_GAUDI
def test_registry_picks_the_plugin_rule_and_falls_back_here() -> None:
    registry = quantreg.Registry.build(env={})
    assert not registry.problems, registry.problems
    assert not [f for f in registry.failures if f.plugin == "hpu_mxfp4"], registry.failures
    assert {"hpu_mxfp4", "hpu_mxfp4_dequant", "mxfp4_reference"} <= set(registry.methods)
    assert all(registry.methods[m].plugin == "hpu_mxfp4" for m in ("hpu_mxfp4", "mxfp4_reference"))

    decision = registry.resolve(KEY)
    assert decision.rule is not None and decision.rule.path == str(plugin.rules_path())
    assert decision.rule.tier == quantreg.Tier.PLUGIN
    assert decision.rule.methods == ("hpu_mxfp4", "hpu_mxfp4_dequant")
    native, dequant = decision.chain
    assert (native.method, native.available) == ("hpu_mxfp4", False)
    assert "habana_frameworks" in native.reason and native.plugin == "hpu_mxfp4"
    assert (dequant.method, dequant.available) == ("hpu_mxfp4_dequant", False)
    assert decision.method == quantreg.VLLM_METHOD and decision.fallback  # no HPU on this machine
    assert decision.candidates[0].won and decision.candidates[-1].rule.tier == quantreg.Tier.DEFAULT


def test_other_keys_are_left_to_vllm() -> None:
    registry = quantreg.Registry.build(env={})
    for key in [("gpt_oss_mxfp4", "gpt_oss", "cpu"), ("fp8", "gpt_oss", "hpu"), ("gpt_oss_mxfp4", "llama", "hpu")]:
        decision = registry.resolve(key)
        # not this plugin's rule nor its methods: vLLM's own, or another installed plugin's (quantreg-cpu-mxfp4
        # routes the CPU key through a host-aware [vllm, cpu_mxfp4])
        assert decision.rule is not None and decision.rule.path != str(plugin.rules_path())
        assert decision.method not in ("hpu_mxfp4", "hpu_mxfp4_dequant", "mxfp4_reference"), decision.summary()


@NO_GAUDI
def test_probes_answer_through_the_registry() -> None:
    registry = quantreg.Registry.build(env={})
    native = registry.availability("hpu_mxfp4", "hpu")
    assert not native.ok and "habana_frameworks" in native.reason
    assert registry.availability("hpu_mxfp4", "cpu").reason == "runs on hpu, not cpu"
    reference = registry.availability("mxfp4_reference", "cpu")
    absent = [m for m in ("torch", "vllm") if importlib.util.find_spec(m) is None]
    if absent:  # core + plugin #1 without torch (issue 31.4): the reference declares requires=(torch, vllm)
        assert not reference.ok and f"requires module '{absent[0]}'" in reference.reason, reference
    else:
        assert reference.ok, reference


@pytest.mark.needs("torch", "vllm")  # mxfp4_reference requires both; without them the chain passes it over
def test_a_user_table_can_choose_the_reference_on_cpu(tmp_path: pytest.TempPathFactory) -> None:
    table = tmp_path / "mine.yaml"  # type: ignore[operator]
    table.write_text(
        "version: 1\nrules:\n"
        "  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}\n"
        "    method: [hpu_mxfp4, mxfp4_reference]\n"
        "    options: {limit: 7.0}\n"
    )
    decision = quantreg.Registry.build(config=[table], env={}).resolve(("gpt_oss_mxfp4", "gpt_oss", "cpu"))
    assert decision.method == "mxfp4_reference" and dict(decision.options) == {"limit": 7.0}
    assert decision.chain[0].reason == "runs on hpu, not cpu"
    cls = quantreg.Registry.build(env={}).methods[decision.method].load()
    assert cls.__name__ == "Mxfp4ReferenceMoEMethod"


def test_registered_option_names_are_the_option_fields() -> None:
    """plugin.py holds the one list of option names (so registering imports nothing else); every
    name has a field in MethodOptions and every field is registered, per method."""
    from quantreg_hpu_mxfp4 import options, plugin

    assert options.FIELDS == plugin.OPTIONS + plugin.SLICING_OPTIONS
    assert options.names("hpu_mxfp4") == plugin.OPTIONS
    assert options.names("hpu_mxfp4_dequant") == plugin.OPTIONS + plugin.SLICING_OPTIONS
