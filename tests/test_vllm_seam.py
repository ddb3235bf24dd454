"""Hardening: strict vs lenient, plugin fault isolation, table-defined methods, security.

Plugins are real distributions (``PluginSite``: dist-info + entry_points.txt on sys.path). The
strict/lenient outcome is what the vLLM seam does with a registry's faults
(:func:`quantreg.vllm.seam.report_faults`): strict raises one error naming the file or plugin,
lenient logs one WARNING per fault and keeps everything else.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from core_support import QUANTREG, PluginSite
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantreg import Key, QuantregError, Registry
from quantreg.table.file import Layer, parse_table
from quantreg.vllm.seam import report_faults

pytestmark = pytest.mark.usefixtures("clean_env")

KEY = Key("fmt", "model", "cpu")
GOOD_RULES = "version: 1\nrules:\n  - match: {quant_format: fmt}\n    method: good\n"


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


def test_strict_true_in_a_broken_user_table_still_means_strict(tmp_path: Path) -> None:
    bad = tmp_path / "user.yaml"
    bad.write_text("version: 1\nstrict: true\nrules:\n  - match: {device: cpu}\n    method: nope\n")
    registry = Registry.build(env={"QUANTREG_CONFIG": str(bad)})
    assert registry.tables and all(t.path != str(bad) for t in registry.tables)  # the table itself is dropped
    assert registry.strict  # ... but its request for strict mode is not silently lost


def test_plugin_tables_cannot_switch_on_strict_mode(plugin_site: PluginSite) -> None:
    plugin_site.add("qrt-bossy", {"bossy": "qrt_bossy"}, modules={"qrt_bossy": """
import quantreg
from pathlib import Path

@quantreg.hookimpl
def register_tables(register):
    register(Path(__file__).with_name("qrt_bossy.yaml"))
"""}, files={"qrt_bossy.yaml": "version: 1\nstrict: true\nrules: []\n"})
    registry = Registry.build()
    assert any(t.strict for t in registry.tables)
    assert not registry.strict


def test_hanging_probe_is_bounded(plugin_site: PluginSite, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin_site.add("qrt-slow", {"slow": "qrt_slow"}, modules={"qrt_slow": """
import time
import quantreg

def hang():
    time.sleep(30)
    return True, "never reached"

def boom():
    raise OSError("driver not loaded")

@quantreg.hookimpl
def register_methods(register):
    register(quantreg.Method(name="slow", target="qrt_slow:X", probe="qrt_slow:hang"))
    register(quantreg.Method(name="boom", target="qrt_slow:X", probe="qrt_slow:boom"))
"""})
    monkeypatch.setenv("QUANTREG_PROBE_TIMEOUT", "0.3")
    registry = Registry.build()
    start = time.monotonic()
    slow = registry.availability("slow", "cpu")
    assert time.monotonic() - start < 5
    assert not slow.ok and "did not answer within 0.3s" in slow.reason
    boom = registry.availability("boom", "cpu")
    assert not boom.ok and boom.reason == "probe raised OSError: driver not loaded"


def test_nonexistent_target_fails_at_load_naming_it(plugin_site: PluginSite) -> None:
    plugin_site.add("qrt-ghost", {"ghost": "qrt_ghost"}, modules={"qrt_ghost": """
import quantreg

@quantreg.hookimpl
def register_methods(register):
    register(quantreg.Method(name="ghost", target="qrt_ghost:Missing"))
"""})
    registry = Registry.build()
    with pytest.raises(ImportError, match="module 'qrt_ghost' has no attribute 'Missing'"):
        registry.methods["ghost"].load()


# -- security -------------------------------------------------------------------------------


def test_python_object_tag_is_rejected(tmp_path: Path) -> None:
    evil = tmp_path / "evil.yaml"
    evil.write_text("version: 1\nrules:\n  - match: !!python/object/apply:os.system ['echo pwned']\n"
                    "    method: vllm\n")
    out = subprocess.run([str(QUANTREG), "validate", str(evil)], capture_output=True, text=True)
    assert out.returncode == 1 and "pwned" not in out.stdout + out.stderr
    assert f"{evil}:3: rules[0].match: tag 'tag:yaml.org,2002:python/object/apply:os.system' is not allowed" \
        in out.stdout


def test_table_defined_target_needs_explicit_opt_in(tmp_path: Path) -> None:
    evil = tmp_path / "evil.yaml"
    evil.write_text(textwrap.dedent("""\
        version: 1
        methods:
          shell: {target: "os:system"}
        rules:
          - match: {device: cpu}
            method: shell
        """))
    registry = Registry.build(env={"QUANTREG_CONFIG": str(evil)})
    messages = [str(p) for p in registry.problems]
    assert f"{evil}:2: methods: table-defined methods import code named in the table: set " \
           "'allow_import_targets: true' in this table to allow them" in messages
    assert "shell" not in registry.methods and registry.resolve(("x", "y", "cpu")).method == "vllm"


def test_opted_in_target_must_still_be_a_class(tmp_path: Path) -> None:
    table = tmp_path / "mine.yaml"
    table.write_text(textwrap.dedent("""\
        version: 1
        allow_import_targets: true
        methods:
          shell: {target: "os:system", devices: cpu, options: []}
        rules:
          - match: {device: cpu}
            method: shell
        """))
    registry = Registry.build(env={"QUANTREG_CONFIG": str(table)})
    assert registry.problems == ()
    assert registry.methods["shell"].plugin == f"table {table}"
    assert registry.resolve(("x", "y", "cpu")).method == "shell"
    with pytest.raises(TypeError, match="target os:system is a builtin_function_or_method, not a class"):
        registry.methods["shell"].load()


def test_plugin_tables_cannot_define_methods(plugin_site: PluginSite) -> None:
    plugin_site.add("qrt-sneaky", {"sneaky": "qrt_sneaky"}, modules={"qrt_sneaky": """
import quantreg
from pathlib import Path

@quantreg.hookimpl
def register_tables(register):
    register(Path(__file__).with_name("qrt_sneaky.yaml"))
"""}, files={"qrt_sneaky.yaml": "version: 1\nallow_import_targets: true\nmethods:\n  x: {target: 'os:system'}\n"
                                "rules: []\n"})
    registry = Registry.build()
    assert any("only user and run tables may define methods" in str(p) for p in registry.problems)
    assert "x" not in registry.methods


def test_config_paths_are_taken_literally(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "t.yaml").write_text(GOOD_RULES.replace("good", "vllm"))
    registry = Registry.build(env={"QUANTREG_CONFIG": "$HOME/t.yaml" + ":" + "~/t.yaml"})
    assert [str(p) for p in registry.problems] == ["$HOME/t.yaml: no such file", "~/t.yaml: no such file"]


def test_fifty_megabyte_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    with big.open("wb") as f:
        f.truncate(50 << 20)  # sparse: 50 MB on paper, nothing to read if we refuse first
    out = subprocess.run([str(QUANTREG), "validate", str(big)], capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stdout.strip() == f"{big}: file is {50 << 20} bytes; a table may have at most {4 << 20}"


@pytest.mark.vllm_installed
def test_fingerprint_mismatch_between_processes(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        import quantreg.vllm as qv
        try:
            qv.register()
        except Exception as exc:
            print("RAISED", exc)
    """)
    base = {k: v for k, v in __import__("os").environ.items() if not k.startswith("QUANTREG_")}
    lenient = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**base, "QUANTREG_FINGERPRINT": "0123456789abcdef"})
    assert "WARNING quantreg: this process" in lenient.stderr
    assert "than its parent process (0123456789abcdef)" in lenient.stderr
    strict = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**base, "QUANTREG_FINGERPRINT": "0123456789abcdef", "QUANTREG_STRICT": "1"})
    assert strict.stdout.startswith("RAISED quantreg: this process")


# -- fuzzing --------------------------------------------------------------------------------

YAML_TOKENS = ["version:", "rules:", "- ", "match:", "method:", "options:", "priority:", "strict:", "{", "}",
               "[", "]", ",", ":", "\n", "  ", "\t", "'", '"', "&a", "*a", "!!python/object", "!!str", "<<",
               "*", "cpu", "hpu", "vllm", "1", "-1", "2.5", "null", "true", "~", "#", "---", "...", "|", ">",
               "\x00", "\u00e9", "methods:", "allow_import_targets:", "target:", "os:system"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=200), st.lists(st.sampled_from(YAML_TOKENS), max_size=60).map("".join)))
def test_loader_never_raises_on_random_documents(text: str) -> None:
    table, problems, _ = parse_table(text, "fuzz.yaml", Layer.USER)
    assert (table is None) == bool(problems)  # a document is either a table or a list of located problems
    for problem in problems:
        assert str(problem).startswith("fuzz.yaml")
        assert problem.line is None or problem.line >= 1


names = st.sampled_from(["a", "b", "c"])
match_values = st.one_of(st.just("*"), names, st.lists(names, min_size=1, max_size=2, unique=True))
rules = st.lists(st.fixed_dictionaries({"quant_format": match_values, "device": match_values,
                                        "priority": st.integers(-1, 1)}), max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rules)
def test_tables_that_validate_resolve_every_key_deterministically(tmp_path: Path,
                                                                 rows: list[dict[str, object]]) -> None:
    import json

    body = "".join(f"  - match: {{quant_format: {json.dumps(r['quant_format'])}, device: {json.dumps(r['device'])}}}\n"
                   f"    method: vllm\n    priority: {r['priority']}\n" for r in rows)
    path = tmp_path / "t.yaml"
    path.write_text("version: 1\nrules:\n" + (body or "  []\n"))
    first = Registry.build(env={"QUANTREG_CONFIG": str(path)}, entry_points=False)
    if first.problems:  # only ambiguity can make these tables invalid, and then nothing of them applies
        assert all("ambiguous" in p.message for p in first.problems)
        assert all(t.path != str(path) for t in first.tables)
        return
    second = Registry.build(env={"QUANTREG_CONFIG": str(path)}, entry_points=False)
    for key in [(q, "m", d) for q in "abcz" for d in "abcz"]:
        a, b = first.resolve(key), second.resolve(key)
        assert (a.method, a.source) == (b.method, b.source)
        assert first.resolve(key) is a  # cached


# -- plugin faults at layer build, through the seam, in both modes ----------------------------

SEAM_FAULTS = {
    "missing_target": "method 'missing_target' for (missing_target, unknown, cpu) [{table}:3] could not be built: "
                      "ImportError: module 'qrt_faulty' has no attribute 'Nope'",
    "not_a_class": "method 'not_a_class' for (not_a_class, unknown, cpu) [{table}:5] could not be built: "
                   "TypeError: method 'not_a_class' target qrt_faulty:function is a function, not a class",
    "not_moe_method": "method 'not_moe_method' for (not_moe_method, unknown, cpu) [{table}:7] could not be built: "
                      "TypeError: method 'not_moe_method' target qrt_faulty:Plain does not subclass vLLM's "
                      "FusedMoEMethodBase",
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
            assert results[name].startswith("RAISED QuantregError"), (name, results[name])
            assert message in results[name] or message.split("; fallback")[0] in results[name], (name, results[name])
        else:
            assert results[name] == "-> VLLM-OWN", (name, results[name])  # vLLM's own method for that layer
            assert message in out.stderr, (name, out.stderr[-3000:])  # ... and one WARNING saying why
