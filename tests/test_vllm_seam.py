"""quantreg.vllm.seam: what the seam does with faults, strict and lenient.

The strict/lenient outcome of a registry's faults (:func:`quantreg.vllm.route.report_faults`): strict
raises one error naming the file or plugin, lenient logs one WARNING per fault and keeps everything
else; plugin faults at layer build through ``Seam.route`` in both modes; ``Seam.route``'s one boundary
for the unforeseen. Plugins are real distributions (``PluginSite``).

History (issue 24 class 5): this was tests/test_hardening.py (strict vs lenient, plugin fault isolation,
security), renamed here; its table, mode, method and registry tests moved to the modules they test; the
route boundary came from tests/test_containment_plugins.py (issue 12, plugin and start-up classes)
(class 1).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from core_support import GOOD_RULES, PluginSite, child_env

from quantreg import Key, QuantregError, Registry
from quantreg.vllm.route import report_faults

pytestmark = pytest.mark.usefixtures("clean_env")


# -- from test_containment_plugins.py (issue 12, plugin and start-up classes) -----------------


SEAM_BOUNDARY = """
import json, sys
from quantreg.problems import QuantregError
from quantreg.vllm.seam import Seam

class Halt(BaseException):
    pass

class ThirdPartyConfig:  # a quant config from another plugin whose get_name() misbehaves
    def get_name(self):
        raise Halt("get_name is broken")

calls = []
def vllms_own(layer, prefix, quant_config, moe_config):
    calls.append(prefix)
    if prefix == "vllm-fails":
        raise ValueError("vLLM's own error")
    return "vllm's method"

seam = Seam()
result = {}
try:
    result["built"] = seam.route(vllms_own, None, "model.layers.0.mlp.experts", ThirdPartyConfig(), None)
except QuantregError as exc:
    result["raised"] = str(exc)
try:
    seam.route(vllms_own, None, "vllm-fails", None, None)
except ValueError as exc:
    result["vllm_error"] = str(exc)
result["calls"] = calls
print(json.dumps(result))
"""


@pytest.mark.parametrize("strict", [False, True])
def test_the_seam_route_has_one_boundary(strict: bool) -> None:
    pytest.importorskip("vllm")
    env = child_env(None, "", **({"QUANTREG_STRICT": "1"} if strict else {}))
    out = subprocess.run([sys.executable, "-c", SEAM_BOUNDARY], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data["vllm_error"] == "vLLM's own error"  # what vLLM raises is vLLM's, untouched
    if strict:
        assert data["raised"] == ("quantreg (strict): routing model.layers.0.mlp.experts failed unexpectedly: "
                                  "Halt: get_name is broken")
        assert data["calls"] == ["vllm-fails"]
    else:
        assert data["built"] == "vllm's method"
        assert data["calls"] == ["model.layers.0.mlp.experts", "vllm-fails"]
        assert ("quantreg: routing model.layers.0.mlp.experts failed unexpectedly: Halt: get_name is broken; "
                "using vLLM's own method") in out.stderr


# -- from test_hardening.py (strict vs lenient, fault isolation, security) --------------------


KEY = Key("fmt", "model", "cpu")


def add_good_plugin(site: PluginSite) -> None:
    site.add("qrt-good", {"good": "qrt_good"}, modules={"qrt_good": """
import quantreg
from pathlib import Path

@quantreg.hookimpl
def register_methods(register):
    register(quantreg.Method(name="good", target="qrt_good:Cls"))

@quantreg.hookimpl
def register_tables(register):
    register(Path(__file__).with_name("qrt_good_rules.yaml"))

class Cls:
    pass
"""}, files={"qrt_good_rules.yaml": GOOD_RULES})


BROKEN_PLUGINS = {
    "import_error": "raise ImportError('no such runtime: libfoo.so')\n",
    "hook_raises": """
import quantreg

@quantreg.hookimpl
def register_methods(register):
    register(quantreg.Method(name="half", target="qrt_broken:X"))
    raise RuntimeError("device query failed")
""",
    "misspelt_hook": """
import quantreg

@quantreg.hookimpl
def register_method(register):
    pass
""",
}


@pytest.mark.parametrize("fault", sorted(BROKEN_PLUGINS))
def test_broken_plugin_lenient_warns_and_the_rest_works(plugin_site: PluginSite, fault: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    add_good_plugin(plugin_site)
    plugin_site.add("qrt-broken", {"broken": "qrt_broken"}, modules={"qrt_broken": BROKEN_PLUGINS[fault]})
    registry = Registry.build()
    assert [f.plugin for f in registry.failures] == ["broken"]
    assert "half" not in registry.methods  # a hook that raised leaves nothing half-registered
    assert registry.resolve(KEY).method == "good"  # the good plugin's method and table still work
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg"):
        report_faults(registry, strict=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "plugin 'broken'" in warnings[0]


@pytest.mark.parametrize("fault", sorted(BROKEN_PLUGINS))
def test_broken_plugin_strict_fails_with_one_line_naming_it(plugin_site: PluginSite, fault: str) -> None:
    add_good_plugin(plugin_site)
    plugin_site.add("qrt-broken", {"broken": "qrt_broken"}, modules={"qrt_broken": BROKEN_PLUGINS[fault]})
    with pytest.raises(QuantregError) as err:
        report_faults(Registry.build(env={"QUANTREG_STRICT": "1"}), strict=True)
    text = str(err.value)
    assert "\n" not in text and text.startswith("quantreg (strict): plugin 'broken'")


def test_bad_user_table_lenient_keeps_defaults_strict_names_file_line(table: object, tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    bad = tmp_path / "user.yaml"
    bad.write_text("version: 1\nrules:\n  - match: {quant_format: fmt}\n    methd: vllm\n")
    lenient = Registry.build(env={"QUANTREG_CONFIG": str(bad)})
    assert [t.path for t in lenient.tables] == [t.path for t in Registry.build(env={}).tables]  # defaults only
    assert lenient.resolve(KEY).method == "vllm"
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg"):
        report_faults(lenient, strict=False)
    assert any(f"{bad}:4: rules[0].methd: unknown key" in r.getMessage() for r in caplog.records)
    with pytest.raises(QuantregError, match=rf"{bad}:4: rules\[0\]\.methd"):
        report_faults(Registry.build(env={"QUANTREG_CONFIG": str(bad), "QUANTREG_STRICT": "1"}), strict=True)


OWNER = "(plugin 'faulty', distribution qrt-faulty)"  # whose code failed: the plugin and its distribution
SEAM_FAULTS = {
    "missing_target": f"method 'missing_target' {OWNER} for (missing_target, unknown, cpu) [{{table}}:3] "
                      "could not be built: ImportError: module 'qrt_faulty' has no attribute 'Nope'",
    "not_a_class": f"method 'not_a_class' {OWNER} for (not_a_class, unknown, cpu) [{{table}}:5] "
                   "could not be built: TypeError: method 'not_a_class' target qrt_faulty:function is a function, "
                   "not a class",
    "not_moe_method": f"method 'not_moe_method' {OWNER} for (not_moe_method, unknown, cpu) [{{table}}:7] "
                      "could not be built: TypeError: method 'not_moe_method' target qrt_faulty:Plain does not "
                      "subclass vLLM's FusedMoEMethodBase",
    # the decision line (quantreg.answer): key -> method [rule]; the fallback; the chain
    "hanging_probe": "(hanging_probe, unknown, cpu) -> vllm [{table}:9]; fallback: no method in the chain is "
                     "available here; vLLM keeps its own method; chain: hanging_probe: passed over: ",
    "raising_probe": "(raising_probe, unknown, cpu) -> vllm [{table}:11]; fallback: no method in the chain is "
                     "available here; vLLM keeps its own method; chain: raising_probe: passed over: ",
}


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.parametrize("strict", [False, True])
def test_faulty_methods_at_layer_build(plugin_site: PluginSite, tmp_path: Path, strict: bool) -> None:
    """Real vLLM imports (seam, platform, FusedMoEMethodBase) in a subprocess, one call per fault."""
    plugin_site.add("qrt-faulty", {"faulty": "qrt_faulty"}, modules={"qrt_faulty": """
import time
import quantreg

def function():
    pass

class Plain:
    pass

def hang():
    time.sleep(30)

def boom():
    raise RuntimeError("no device")

@quantreg.hookimpl
def register_methods(register):
    register(quantreg.Method(name="missing_target", target="qrt_faulty:Nope"))
    register(quantreg.Method(name="not_a_class", target="qrt_faulty:function"))
    register(quantreg.Method(name="not_moe_method", target="qrt_faulty:Plain"))
    register(quantreg.Method(name="hanging_probe", target="qrt_faulty:Plain", probe="qrt_faulty:hang"))
    register(quantreg.Method(name="raising_probe", target="qrt_faulty:Plain", probe="qrt_faulty:boom"))
"""})
    table = tmp_path / "faults.yaml"
    table.write_text("version: 1\nrules:\n" + "".join(
        f"  - match: {{quant_format: {name}}}\n    method: {name}\n" for name in SEAM_FAULTS))
    script = textwrap.dedent("""
        import sys
        from quantreg.vllm.seam import Seam

        class Config:
            def __init__(self, name): self.name = name
            def get_name(self): return self.name

        seam = Seam()
        for name in sys.argv[1:]:
            try:
                got = seam.route(lambda *a: "VLLM-OWN", None, "layer", Config(name), None)
                print(name, "->", got)
            except Exception as exc:
                print(name, "RAISED", type(exc).__name__, str(exc).replace("\\n", " "))
    """)
    env = plugin_site.env(QUANTREG_CONFIG=str(table), QUANTREG_PROBE_TIMEOUT="0.5",
                          QUANTREG_STRICT="1" if strict else "0", VLLM_LOGGING_LEVEL="INFO")
    out = subprocess.run([sys.executable, "-c", script, *SEAM_FAULTS], capture_output=True, text=True, env=env,
                         timeout=300)
    results = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.split(" ", 1)[0] in SEAM_FAULTS)
    assert set(results) == set(SEAM_FAULTS), out.stdout + out.stderr[-3000:]
    for name, expected in SEAM_FAULTS.items():
        message = expected.format(table=table)
        if strict:
            assert results[name].startswith("RAISED QuantregError quantreg (strict): "), (name, results[name])
            assert message in results[name] or message.split("; fallback")[0] in results[name], (name, results[name])
        else:
            assert results[name] == "-> VLLM-OWN", (name, results[name])  # vLLM's own method for that layer
            assert message in out.stderr, (name, out.stderr[-3000:])  # ... and one WARNING saying why
