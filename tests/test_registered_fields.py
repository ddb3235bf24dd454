"""Every field of every value a plugin registers survives registration (issue 31.3).

Why: quantreg re-makes each registered value as its own type, stamped with the plugin's name.
Copies written out field by field forgot ``expert_layout`` and then ``host`` (a plugin's CPU
needs were ignored: ``explain`` chose an AVX2 kernel on a host without AVX2). Here one real
distribution (an entry point in group ``quantreg``) registers one value of each registered type
with *every* field set away from its default, and a fresh interpreter runs the real entry
points of ``explain``, ``plan``, ``tune`` and the vLLM start-up hook (``quantreg.vllm.register``):
each one's registry must hold every field as registered. A field added to a value type makes
:func:`test_the_plugin_sets_every_field_away_from_its_default` fail until it is set here too.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from core_support import PluginSite, run_quantreg

import quantreg
from quantreg.hookspecs import hook_names, registered_type

pytestmark = pytest.mark.usefixtures("clean_env")

PLUGIN = "every_field"
MODULE = "qrt_every_field"
SOURCE = '''
import quantreg
from quantreg import Finding, Key, Method, QuantConfigKeeper, VllmLimitation


def probe():
    return True, "probe says yes"


def applies():
    return True


def keep(module, should_keep):
    return None


@quantreg.hookimpl
def register_methods(register):
    register(Method(name="every_field", target="qrt_every_field:Impl", devices=["cpu", "hpu"],
                    requires=["json"], vllm_version=">=0.1", probe="qrt_every_field:probe",
                    description="sets every field", options=["chunk"], option_values={"chunk": (1, 2)},
                    expert_layout="bf16",
                    host=["cpu:avx2", "cpu:fma"], layers=("experts", "lm_head"), plugin="claimed-by-the-value",
                    numerics="weights int8 per 32-block"))


@quantreg.hookimpl
def register_tables(register):
    pass


@quantreg.hookimpl
def register_quant_config_keepers(register):
    register(QuantConfigKeeper(name="every_field_keeper", quant_method="mxfp4", quant_format="qrt_fmt",
                               model_type="qrt_model", module="qrt_every_field_stripper",
                               target="qrt_every_field:keep", description="keeps every field",
                               plugin="claimed-by-the-value"))


@quantreg.hookimpl
def doctor_findings(register):
    register(Finding(level="warning", message="every field", key=Key("qrt_fmt", "qrt_model", "cpu"),
                     plugin="claimed-by-the-value"))


@quantreg.hookimpl
def register_vllm_limitations(register):
    register(VllmLimitation(reason="every field", quant_format=("qrt_fmt", "other"), model_type="qrt_model",
                            device="cpu", applies="qrt_every_field:applies", source="vllm/somewhere.py:1",
                            plugin="claimed-by-the-value"))
'''

#: What each command's registry held, per registered type, printed as JSON by a fresh interpreter.
#: ``Registry.build`` is the one builder every command calls: it is wrapped to keep what it returned,
#: and then each command runs through its real entry point (``cli.main``, ``quantreg.vllm.register``).
CHILD = r'''
import dataclasses, json, os, sys, tempfile
import quantreg.registry as registry_module
from quantreg import cli

built = []
original = registry_module.Registry.build.__func__

def recording(cls, *args, **kwargs):
    registry = original(cls, *args, **kwargs)
    built.append(registry)
    return registry

registry_module.Registry.build = classmethod(recording)

def fields(value):
    return {f.name: repr(getattr(value, f.name)) for f in dataclasses.fields(value)}

def dump(registry):
    from quantreg.vllm.quantconfig import collect_keepers
    limitations, _ = registry.limitations()
    return {
        "Method": [fields(m) for m in registry.methods.values() if m.name == "every_field"],
        "QuantConfigKeeper": [fields(k) for k in collect_keepers(registry)],
        "Finding": [fields(f) for f in registry.findings("cpu") if f.plugin == "every_field"],
        "VllmLimitation": [fields(l) for l in limitations if l.plugin == "every_field"],
        "failures": [str(f) for f in registry.failures],
    }

empty = tempfile.mkdtemp()
seen = {}
for command, argv in (("explain", ["explain", "qrt_fmt", "qrt_model", "cpu", "--json"]),
                      ("plan", ["plan", empty, "--device", "cpu", "--json"]),
                      ("tune", ["tune", empty, "--json"])):
    before = len(built)
    try:
        cli.main(argv)
    except SystemExit:
        pass
    assert len(built) == before + 1, (command, len(built) - before)
    seen[command] = dump(built[-1])

import quantreg.vllm
quantreg.vllm.register()
seen["vllm"] = dump(registry_module.get_registry())
print("FIELDS " + json.dumps(seen))
'''


def _registered(site: PluginSite) -> dict[str, Any]:
    """Each hook's registered value, made by calling the plugin module's hooks here."""
    module = __import__(MODULE)
    found: dict[str, Any] = {}
    for hook in hook_names():
        items: list[Any] = []
        kwargs = {"register": items.append}
        getattr(module, hook)(**kwargs)
        for item in items:
            found[type(item).__name__] = item
    return found


@pytest.fixture
def site(plugin_site: PluginSite) -> PluginSite:
    plugin_site.add("qrt-every-field", {PLUGIN: MODULE}, modules={MODULE: SOURCE})
    return plugin_site


def test_the_plugin_sets_every_field_away_from_its_default(site: PluginSite) -> None:
    """Each hook that registers values is covered, and every field of each value differs from its default."""
    registered = _registered(site)
    types = {registered_type(h) for h in hook_names()} - {registered_type("register_tables")}
    assert {t.__name__ for t in types} == set(registered) == {"Method", "QuantConfigKeeper", "Finding",
                                                              "VllmLimitation"}
    for value in registered.values():
        for f in dataclasses.fields(value):
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else object())
            assert getattr(value, f.name) != default, f"{type(value).__name__}.{f.name} is left at its default"


def _expected(value: Any) -> dict[str, str]:
    """The registered value as quantreg keeps it: sequences as tuples, owned by the entry point's name."""
    def plain(v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else v

    return {f.name: repr(PLUGIN if f.name == "plugin" else plain(getattr(value, f.name)))
            for f in dataclasses.fields(value)}


def test_every_field_survives_into_explain_plan_tune_and_a_vllm_process(site: PluginSite) -> None:
    registered = _registered(site)
    env = site.env(QUANTREG_PLUGINS=PLUGIN)
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("FIELDS ")]
    assert lines, out.stderr[-3000:]
    seen = json.loads(lines[-1][len("FIELDS "):])
    assert set(seen) == {"explain", "plan", "tune", "vllm"}
    for command, held in seen.items():
        assert held["failures"] == [], (command, held["failures"])
        for type_name, value in registered.items():
            assert held[type_name] == [_expected(value)], (command, type_name)


def test_a_declared_host_need_is_honoured_by_explain(site: PluginSite, tmp_path: Path) -> None:
    """The dropped ``host``: on a host simulated without AVX2 the method is passed over, by its declaration."""
    table = tmp_path / "rules.yaml"
    table.write_text("version: 1\nrules:\n  - match: {quant_format: qrt_fmt, model_type: qrt_model, device: cpu}\n"
                     "    method: [every_field, vllm]\n", encoding="utf-8")
    answers = {}
    for flags in ("-avx2", "+avx2,+fma"):
        out = run_quantreg("explain", "qrt_fmt", "qrt_model", "cpu", "--config", str(table), "--json",
                           site=site, plugins=PLUGIN, QUANTREG_HOST_CPU_FLAGS=flags)
        assert out.returncode == 0, out.stderr[-2000:]
        answers[flags] = json.loads(out.stdout)
    assert answers["-avx2"]["method"] == "vllm"
    chain = json.dumps(answers["-avx2"]["chain"])
    assert '"method": "every_field", "available": false, "reason": "needs cpu flag avx2' in chain, chain
    assert "needs cpu flag" not in json.dumps(answers["+avx2,+fma"]["chain"])
    if importlib.util.find_spec("vllm") is not None:  # its vllm_version needs vLLM
        assert answers["+avx2,+fma"]["method"] == "every_field"


def test_quantreg_exports_every_registered_type() -> None:
    """A plugin builds each registered value from ``quantreg``'s public names (docs/plugins.md)."""
    for hook in hook_names():
        hint = registered_type(hook)
        if isinstance(hint, type):
            assert getattr(quantreg, hint.__name__) is hint
