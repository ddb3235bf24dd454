"""Issue 12, plugin and start-up classes: nothing a plugin, an env setting or a broken strict table does
can crash or hang a vLLM process (lenient), or slip past strict.

Class 1 (BaseException from plugins, the boundaries of ``register()`` and the seam), 5 (plugin
registrations), 6 (slow plugin imports and hooks), 7 (``strict: true`` in a table whose YAML is
broken), 8 (``QUANTREG_*`` settings), 9 (the CLI says what start-up will do) and the rest of 10
(every problem has a line). Plugins are real distributions (:class:`core_support.PluginSite`);
each class is checked in-process, through the real ``quantreg`` console script and through
``quantreg.vllm.register()`` in a fresh interpreter, lenient and strict.
"""

from __future__ import annotations

import importlib
import io
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
from core_support import QUANTREG, QUANTREG_VARS, PluginSite, faults
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import quantreg
from quantreg import Key, Registry
from quantreg.environment import DEFAULT_PROBE_TIMEOUT, probe_timeout, read_seconds
from quantreg.methods import check_method, run_probe
from quantreg.mode import decide_mode
from quantreg.plugins import PluginFailure, Plugins
from quantreg.problems import Problem, QuantregError

pytestmark = pytest.mark.usefixtures("clean_env")

# -- helpers ------------------------------------------------------------------------------------

#: ``register()`` as vLLM calls it (no try), then what the registry holds; exit 3 if it raised.
REGISTER = """
import json, sys
import quantreg.vllm as qv
from quantreg.registry import get_registry
try:
    qv.register()
except BaseException as exc:
    print(json.dumps({"raised": type(exc).__name__, "message": str(exc)}))
    sys.exit(3)
registry = get_registry()
print(json.dumps({"raised": None, "faults": [str(f) for f in registry.faults], "strict": registry.strict,
                  "methods": sorted(registry.methods), "tables": [t.path for t in registry.tables]}))
"""


def add(site: PluginSite, name: str, source: str, **files: str) -> None:
    """Distribution ``qrt-<name>`` with entry point ``<name> = qrt_<name>`` and that module source."""
    site.add(f"qrt-{name}", {name: f"qrt_{name}"}, modules={f"qrt_{name}": textwrap.dedent(source)}, files=files)


def child_env(site: PluginSite | None, plugins: str, **extra: str) -> dict[str, str]:
    env = site.env() if site is not None else {k: v for k, v in os.environ.items() if k not in QUANTREG_VARS}
    env["QUANTREG_PLUGINS"] = plugins
    env.update(extra)
    return env


def register_child(site: PluginSite | None, plugins: str = "", timeout: float = 120,
                   **extra: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``register()`` in a fresh interpreter; the JSON line it printed (a missing line is a failure)."""
    out = subprocess.run([sys.executable, "-c", REGISTER], capture_output=True, text=True,
                         env=child_env(site, plugins, **extra), timeout=timeout)
    lines = out.stdout.strip().splitlines()
    assert lines, f"register() ended the process (rc {out.returncode}) without a word:\n{out.stderr[-2000:]}"
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return out, json.loads(lines[-1])


def cli(*args: str, site: PluginSite | None = None, plugins: str = "",
        **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(QUANTREG), *args], capture_output=True, text=True,
                          env=child_env(site, plugins, **extra), timeout=120)


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else textwrap.dedent(data).lstrip("\n").encode())
    return path


GOOD_METHODS = """
import quantreg

@quantreg.hookimpl
def register_methods(register):
    register(quantreg.Method(name="good_one", target="qrt_nowhere:Impl"))
"""

# -- class 1: BaseException from plugins ---------------------------------------------------------

IMPORT_FAULTS = {
    "exit0": ("import sys\nsys.exit(0)\n", "failed to import: SystemExit: 0"),
    "exit_text": ("raise SystemExit('bye')\n", "failed to import: SystemExit: bye"),
    "custom_base": ("class Stop(BaseException):\n    pass\nraise Stop('halt')\n", "failed to import: Stop: halt"),
    "bad_str": ("class Odd(Exception):\n    def __str__(self):\n        raise RuntimeError('no text')\nraise Odd()\n",
                "failed to import: Odd: <its message could not be read>"),
    "generator_exit": ("raise GeneratorExit('gone')\n", "failed to import: GeneratorExit: gone"),
}

HOOK_FAULTS = {
    "system_exit": ("raise SystemExit(3)", "raised SystemExit: 3"),
    "custom_base": ("raise Halt('stop here')", "raised Halt: stop here"),
    "bad_str": ("raise BadStr()", "raised BadStr: <its message could not be read>"),
    "exit_call": ("import sys; sys.exit(0)", "raised SystemExit: 0"),
}

HOOK_PRELUDE = """
import quantreg

class Halt(BaseException):
    pass

class BadStr(Exception):
    def __str__(self):
        raise ValueError("unprintable")
"""


def hook_plugin(body: str) -> str:
    return HOOK_PRELUDE + f"""
@quantreg.hookimpl
def register_methods(register):
    register(quantreg.Method(name="staged_then_lost", target="qrt_nowhere:Impl"))
    {body}
"""


@pytest.mark.parametrize("kind", sorted(IMPORT_FAULTS))
def test_base_exception_at_import_is_a_plugin_fault(plugin_site: PluginSite, kind: str) -> None:
    source, expected = IMPORT_FAULTS[kind]
    add(plugin_site, "bad", source)
    add(plugin_site, "fine", GOOD_METHODS)
    registry = Registry.build(env={"QUANTREG_PLUGINS": "bad,fine"})
    [fault] = registry.failures
    assert fault.plugin == "bad" and fault.hook == "" and expected in fault.message, fault
    assert "good_one" in registry.methods  # the other plugin is untouched


@pytest.mark.parametrize("kind", sorted(HOOK_FAULTS))
def test_base_exception_in_a_hook_is_a_plugin_fault(plugin_site: PluginSite, kind: str) -> None:
    body, expected = HOOK_FAULTS[kind]
    add(plugin_site, "bad", hook_plugin(body))
    registry = Registry.build(env={"QUANTREG_PLUGINS": "bad"})
    assert faults(registry) == [f"plugin 'bad', hook 'register_methods': {expected}"]
    assert "staged_then_lost" not in registry.methods  # all or nothing per (plugin, hook) call


def test_keyboard_interrupt_still_stops_a_stuck_start_up(plugin_site: PluginSite) -> None:
    add(plugin_site, "ctrlc", hook_plugin("raise KeyboardInterrupt"))
    with pytest.raises(KeyboardInterrupt):
        Registry.build(env={"QUANTREG_PLUGINS": "ctrlc"})


def all_class1_plugins(site: PluginSite) -> str:
    for kind, (source, _) in IMPORT_FAULTS.items():
        add(site, f"imp_{kind}", source)
    for kind, (body, _) in HOOK_FAULTS.items():
        add(site, f"hook_{kind}", hook_plugin(body))
    add(site, "fine", GOOD_METHODS)
    return ",".join([*(f"imp_{k}" for k in IMPORT_FAULTS), *(f"hook_{k}" for k in HOOK_FAULTS), "fine"])


def test_lenient_register_survives_every_base_exception(plugin_site: PluginSite) -> None:
    names = all_class1_plugins(plugin_site)
    out, data = register_child(plugin_site, names)
    assert out.returncode == 0 and data["raised"] is None and data["strict"] is False
    assert len(data["faults"]) == len(IMPORT_FAULTS) + len(HOOK_FAULTS), data["faults"]
    assert "good_one" in data["methods"] and "staged_then_lost" not in data["methods"]
    for kind in IMPORT_FAULTS:
        assert f"quantreg: plugin 'imp_{kind}': entry point qrt_imp_{kind} failed to import" in out.stderr
    for kind in HOOK_FAULTS:
        assert f"quantreg: plugin 'hook_{kind}', hook 'register_methods': raised" in out.stderr
    assert "left out; the other plugins and tables stay in force" in out.stderr


def test_strict_register_raises_one_line_for_every_base_exception(plugin_site: PluginSite) -> None:
    names = all_class1_plugins(plugin_site)
    out, data = register_child(plugin_site, names, QUANTREG_STRICT="1")
    assert out.returncode == 3 and data["raised"] == "QuantregError"
    assert "\n" not in data["message"] and data["message"].startswith("quantreg (strict): ")
    for name in names.split(",")[:-1]:
        assert f"plugin '{name}'" in data["message"], name


@pytest.mark.parametrize("args", [["validate", "BROKEN"], ["validate"], ["list", "--json"],
                                  ["explain", "a", "b", "cpu"]])
def test_a_plugin_calling_sys_exit_cannot_end_the_cli(plugin_site: PluginSite, tmp_path: Path,
                                                      args: list[str]) -> None:
    add(plugin_site, "quitter", IMPORT_FAULTS["exit0"][0])
    broken = write(tmp_path / "broken.yaml", "version: 1\nrules: 5\n")
    args = [str(broken) if a == "BROKEN" else a for a in args]
    out = cli(*args, site=plugin_site, plugins="quitter")
    assert "Traceback" not in out.stderr
    if args[0] == "validate":
        assert out.returncode == 1, out.stdout + out.stderr  # the table (or the plugin) is broken: never 0
        assert (str(broken) if len(args) > 1 else "plugin 'quitter'") in out.stdout
    else:
        assert out.returncode == 0, out.stderr
        assert "plugin 'quitter'" in out.stderr
    if "--json" in args:
        assert any("plugin 'quitter'" in p["text"] for p in json.loads(out.stdout)["problems"])


BOUNDARY = """
import json, sys
import quantreg.registry
from quantreg.problems import QuantregError
import quantreg.vllm as qv

class Unforeseen(BaseException):
    pass

def broken_fingerprint(self):  # an unforeseen fault inside quantreg itself, after the registry is built
    raise Unforeseen("fingerprint exploded")

quantreg.registry.Registry.fingerprint = broken_fingerprint
try:
    qv.register()
except QuantregError as exc:
    print(json.dumps({"raised": "QuantregError", "message": str(exc)}))
    sys.exit(3)
print(json.dumps({"raised": None}))
"""


@pytest.mark.vllm_installed
@pytest.mark.parametrize("strict", [False, True])
def test_register_has_one_boundary_for_the_unforeseen(strict: bool) -> None:
    """A fault no input can trigger any more (fault injection: the boundary is for what nobody foresaw)."""
    env = child_env(None, "", **({"QUANTREG_STRICT": "1"} if strict else {}))
    out = subprocess.run([sys.executable, "-c", BOUNDARY], capture_output=True, text=True, env=env, timeout=120)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert "Traceback" not in out.stderr
    if strict:
        assert out.returncode == 3 and data["message"] == (
            "quantreg (strict): register() failed unexpectedly: Unforeseen: fingerprint exploded")
    else:
        assert out.returncode == 0 and data["raised"] is None
        assert ("quantreg: register() failed unexpectedly: Unforeseen: fingerprint exploded; quantreg is inactive "
                "in this process and vLLM keeps its own MoE methods") in out.stderr


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


# -- class 5: plugin registrations ---------------------------------------------------------------

BAD_METHODS = {
    "name=None": ("quantreg.Method(name=None, target='qrt_x:Y')",
                  "method name None is not valid (letters, digits, '_', '.', '-')"),
    "target=None": ("quantreg.Method(name='m', target=None)",
                    "method 'm': target None is not of the form 'package.module:Class'"),
    "target extra colon": ("quantreg.Method(name='m', target='pkg:Cls:Extra')",
                           "method 'm': target 'pkg:Cls:Extra' is not of the form 'package.module:Class'"),
    "devices=None": ("quantreg.Method(name='m', target='qrt_x:Y', devices=None)",
                     "method 'm': devices must be a tuple of device names such as ('hpu',), got NoneType None"),
    "devices str": ("quantreg.Method(name='m', target='qrt_x:Y', devices='hpu')",
                    "method 'm': devices must be a tuple of device names such as ('hpu',), got str 'hpu'"),
    "devices item": ("quantreg.Method(name='m', target='qrt_x:Y', devices=('hpu', 3))",
                     "method 'm': devices holds 3, which is not one of the device names"),
    "requires str": ("quantreg.Method(name='m', target='qrt_x:Y', requires='torch')",
                     "method 'm': requires must be a tuple of module names such as ('my_runtime',), got str 'torch'"),
    "requires item": ("quantreg.Method(name='m', target='qrt_x:Y', requires=('torch', 'not a module'))",
                      "method 'm': requires holds 'not a module', which is not one of the module names"),
    "options str": ("quantreg.Method(name='m', target='qrt_x:Y', options='chunk')",
                    "method 'm': options must be a tuple of option names such as ('chunk',), got str 'chunk'"),
    "options item": ("quantreg.Method(name='m', target='qrt_x:Y', options=(None,))",
                     "method 'm': options holds None, which is not one of the option names"),
    "vllm_version int": ("quantreg.Method(name='m', target='qrt_x:Y', vllm_version=30)",
                         "method 'm': vllm_version must be a string such as '>=0.30,<0.40' or None, got int"),
    "probe int": ("quantreg.Method(name='m', target='qrt_x:Y', probe=42)",
                  "method 'm': probe must be a callable or 'package.module:function', got 42"),
    "probe bad target": ("quantreg.Method(name='m', target='qrt_x:Y', probe='no colon')",
                         "method 'm': probe must be a callable or 'package.module:function', got 'no colon'"),
    "description": ("quantreg.Method(name='m', target='qrt_x:Y', description=None)",
                    "method 'm': description must be a string, got NoneType"),
}


@pytest.mark.parametrize("case", sorted(BAD_METHODS))
def test_every_method_field_is_type_checked(plugin_site: PluginSite, case: str) -> None:
    expr, expected = BAD_METHODS[case]
    add(plugin_site, "sloppy", f"""
import quantreg

@quantreg.hookimpl
def register_methods(register):
    register({expr})
    register(quantreg.Method(name="kept", target="qrt_x:Y", devices=["cpu"]))
""")
    registry = Registry.build(env={"QUANTREG_PLUGINS": "sloppy"})
    assert faults(registry) == [f"plugin 'sloppy', hook 'register_methods': {expected}"]
    assert set(registry.methods) == {"vllm", "kept"}
    assert registry.methods["kept"].devices == ("cpu",)  # a list is stored as a tuple
    list_out = cli("list", "--json", "--device", "pu", site=plugin_site, plugins="sloppy")
    assert list_out.returncode == 0 and "Traceback" not in list_out.stderr
    assert [p["text"] for p in json.loads(list_out.stdout)["problems"]] == faults(registry)


def test_devices_as_a_string_never_matches_a_substring() -> None:
    registry = Registry.build(env={}, entry_points=False, plugins=[("p", _Registers(
        quantreg.Method(name="h", target="qrt_x:Y", devices="hpu")))])  # type: ignore[arg-type]
    assert "h" not in registry.methods and registry.availability("h", "pu").ok is False


class _Registers:
    """A plugin object (Plugins.add) registering the given items and returning ``returns``."""

    def __init__(self, *items: Any, returns: Any = None) -> None:
        self.items, self.returns = items, returns

    @quantreg.hookimpl
    def register_methods(self, register: Any) -> Any:
        for item in self.items:
            register(item)
        return self.returns


def test_check_method_accepts_the_documented_forms() -> None:
    ok = quantreg.Method(name="m", target="pkg.mod:Cls.inner", devices=["cpu", "hpu"], requires=("a.b",),
                         vllm_version=">=0.30", probe="pkg.probe:check", options=["chunk"], description="d")
    assert check_method(ok) is None
    assert check_method(quantreg.Method(name="m", target="p:C", probe=lambda: (True, "ok"), vllm_version="")) is None


def test_a_hook_returning_methods_is_a_fault(plugin_site: PluginSite) -> None:
    add(plugin_site, "returner", """
import quantreg

@quantreg.hookimpl
def register_methods(register):
    register(quantreg.Method(name="registered", target="qrt_x:Y"))
    return [quantreg.Method(name="returned", target="qrt_x:Y")]

@quantreg.hookimpl
def register_tables(register):
    return "rules.yaml"
""")
    registry = Registry.build(env={"QUANTREG_PLUGINS": "returner"})
    assert faults(registry) == [
        "plugin 'returner', hook 'register_methods': returned a value (list); call register(...) instead",
        "plugin 'returner', hook 'register_tables': returned a value (str); call register(...) instead"]
    assert "registered" in registry.methods and "returned" not in registry.methods


def test_two_distributions_with_one_entry_point_name(plugin_site: PluginSite) -> None:
    plugin_site.add("qrt-first", {"shared": "qrt_first"}, modules={"qrt_first": GOOD_METHODS})
    plugin_site.add("qrt-second", {"shared": "qrt_second"}, modules={"qrt_second": GOOD_METHODS.replace(
        "good_one", "second_one")})
    registry = Registry.build(env={"QUANTREG_PLUGINS": "shared"})
    [fault] = faults(registry)
    assert fault.startswith("plugin 'shared': entry point name 'shared' is provided by two distributions: ")
    assert "'qrt-first' (qrt_first)" in fault and "'qrt-second' (qrt_second)" in fault
    assert ("good_one" in registry.methods) != ("second_one" in registry.methods)  # exactly one is loaded
    out = cli("plugins", "--json", site=plugin_site, plugins="shared")
    assert json.loads(out.stdout)["faults"] == [fault]


def test_the_same_distribution_seen_twice_is_not_a_fault(plugin_site: PluginSite, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    plugin_site.add("qrt-twice", {"twice": "qrt_twice"}, modules={"qrt_twice": GOOD_METHODS})
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "qrt_twice-0.1.dist-info").symlink_to(plugin_site.root / "qrt_twice-0.1.dist-info")
    monkeypatch.syspath_prepend(str(copy))
    importlib.invalidate_caches()
    registry = Registry.build(env={"QUANTREG_PLUGINS": "twice"})
    assert faults(registry) == [] and "good_one" in registry.methods


def test_a_failing_hook_keeps_nothing_from_that_call_and_the_plugin_keeps_its_other_hooks(
        plugin_site: PluginSite) -> None:
    add(plugin_site, "half", """
import quantreg
from pathlib import Path

@quantreg.hookimpl
def register_methods(register):
    register(quantreg.Method(name="half_first", target="qrt_x:Y"))
    raise RuntimeError("second method failed")

@quantreg.hookimpl
def register_tables(register):
    register(Path(__file__).with_name("half.yaml"))
""", **{"half.yaml": "version: 1\nrules:\n  - {match: {quant_format: fmt_half}, method: vllm, note: half}\n"})
    registry = Registry.build(env={"QUANTREG_PLUGINS": "half"})
    assert faults(registry) == ["plugin 'half', hook 'register_methods': raised RuntimeError: second method failed"]
    assert "half_first" not in registry.methods
    decision = registry.resolve(Key("fmt_half", "m", "cpu"))
    assert decision.rule is not None and decision.rule.note == "half"  # its table (another hook) is kept


def test_a_registered_path_that_cannot_be_read_is_a_fault() -> None:
    class BadPath:
        def __fspath__(self) -> str:
            raise OSError("no path today")

    class BytesPath:
        def __fspath__(self) -> bytes:
            return b"/tmp/x.yaml"

    class Tables:
        @quantreg.hookimpl
        def register_tables(self, register: Any) -> None:
            register(BadPath())
            register(BytesPath())

    registry = Registry.build(env={}, entry_points=False, plugins=[("paths", Tables())])
    assert faults(registry) == [
        "plugin 'paths', hook 'register_tables': the registered path cannot be read: OSError: no path today",
        "plugin 'paths', hook 'register_tables': register() expects a str path, got bytes"]


def test_str_subclasses_are_stored_as_plain_strings() -> None:
    class Touchy(str):
        def __lt__(self, other: object) -> bool:
            raise RuntimeError("do not sort me")

        __hash__ = str.__hash__

    registry = Registry.build(env={}, entry_points=False, plugins=[("touchy", _Registers(
        quantreg.Method(name=Touchy("touchy_m"), target=Touchy("qrt_x:Y"))))])
    assert type(registry.methods["touchy_m"].name) is str and type(registry.methods["touchy_m"].target) is str
    assert len(registry.fingerprint()) == 16  # sorting inside fingerprint() no longer meets the override


@pytest.mark.parametrize("strict", [False, True])
def test_registrations_through_register_in_a_subprocess(plugin_site: PluginSite, strict: bool) -> None:
    regs = "\n".join(f"    register({expr})" for expr, _ in BAD_METHODS.values())
    add(plugin_site, "sloppy", f"import quantreg\n\n@quantreg.hookimpl\ndef register_methods(register):\n{regs}\n"
                               "    return 1\n")
    out, data = register_child(plugin_site, "sloppy", **({"QUANTREG_STRICT": "1"} if strict else {}))
    if strict:
        assert out.returncode == 3 and data["raised"] == "QuantregError" and "\n" not in data["message"]
        for _, expected in BAD_METHODS.values():
            assert expected in data["message"]
    else:
        assert data["raised"] is None and len(data["faults"]) == len(BAD_METHODS) + 1
        assert data["faults"][0] == ("plugin 'sloppy', hook 'register_methods': returned a value (int); "
                                      "call register(...) instead")


# -- class 6: slow plugins are named while they block ----------------------------------------------

def test_a_plugin_slow_to_import_is_logged_while_it_loads(plugin_site: PluginSite) -> None:
    add(plugin_site, "slow", "import time\ntime.sleep(1.5)\n" + GOOD_METHODS)
    add(plugin_site, "slowhook", """
import time
import quantreg

@quantreg.hookimpl
def register_tables(register):
    time.sleep(1.2)
""")
    out, data = register_child(plugin_site, "slow,slowhook")
    assert data["raised"] is None and data["faults"] == [] and "good_one" in data["methods"]
    assert "quantreg: still loading plugin 'slow' (entry point qrt_slow) after 1 s" in out.stderr
    assert "quantreg: loading plugin 'slow' (entry point qrt_slow) took 1.5 s" in out.stderr
    assert "quantreg: still calling hook 'register_tables' of plugin 'slowhook' after 1 s" in out.stderr
    # the "still" line comes before the import finished: it is there while a stuck runtime still blocks
    assert out.stderr.index("still loading plugin 'slow'") < out.stderr.index("loading plugin 'slow' (entry point "
                                                                              "qrt_slow) took")
    fast = cli("list", site=plugin_site, plugins="slow")
    assert "still loading plugin 'slow'" in fast.stderr and fast.returncode == 0


def test_fast_plugins_log_nothing(plugin_site: PluginSite) -> None:
    add(plugin_site, "fast", GOOD_METHODS)
    out, data = register_child(plugin_site, "fast")
    assert data["faults"] == [] and "quantreg: still" not in out.stderr and " took " not in out.stderr


# -- class 7: strict in a table whose YAML is broken, in either order -------------------------------

YAML_FAULTS: dict[str, bytes] = {
    "duplicate key": b"rules: []\nrules: []\n",
    "timestamp": b"rules: []\nwhen: 2024-01-01\n",
    "non-UTF-8 byte": b"rules: []\nnote: caf\xe9\n",
    "control character": b"rules: []\nnote: a\x07b\n",
    "syntax error": b"rules: [}\n",
}


def strict_broken(tmp_path: Path, kind: str, header: bytes = b"version: 1\nstrict: true\n") -> Path:
    return write(tmp_path / f"{kind.replace(' ', '_')}.yaml", header + YAML_FAULTS[kind])


@pytest.mark.parametrize("order", ["broken first", "broken last"])
@pytest.mark.parametrize("kind", sorted(YAML_FAULTS))
def test_strict_is_honoured_whatever_the_yaml_fault_and_the_order(tmp_path: Path, kind: str, order: str) -> None:
    broken = strict_broken(tmp_path, kind)
    plain = write(tmp_path / "plain.yaml", "version: 1\nrules:\n  - {match: {device: cpu}, method: vllm}\n")
    paths = [broken, plain] if order == "broken first" else [plain, broken]
    registry = Registry.build(env={"QUANTREG_CONFIG": os.pathsep.join(map(str, paths)), "QUANTREG_PLUGINS": ""})
    assert [p.path for p in registry.problems] == [str(broken)]
    assert registry.mode().because == (f"strict: true in {broken}",)


@pytest.mark.parametrize("kind", ["non-UTF-8 byte", "syntax error"])
def test_strict_broken_table_stops_register_and_the_cli(tmp_path: Path, kind: str) -> None:
    broken = strict_broken(tmp_path, kind)
    out, data = register_child(None, QUANTREG_CONFIG=str(broken))
    assert out.returncode == 3 and data["raised"] == "QuantregError" and str(broken) in data["message"]
    answer = cli("explain", "fp8", "llama", "cpu", QUANTREG_CONFIG=str(broken))
    assert answer.returncode == 1 and f"vLLM would refuse to start (strict: true in {broken}): " in answer.stderr


@pytest.mark.parametrize("header", [b"version: 1\nstrict: false\n", b"version: 1\n  strict: true\n",
                                    b"version: 1\n# strict: true\n", b"version: 1\nnot_strict: true\n",
                                    b"version: 1\nstrict: yes\n"])
def test_only_a_top_level_strict_true_line_counts(tmp_path: Path, header: bytes) -> None:
    broken = strict_broken(tmp_path, "syntax error", header)
    registry = Registry.build(env={"QUANTREG_CONFIG": str(broken), "QUANTREG_PLUGINS": ""})
    assert registry.problems and not registry.mode().strict


@pytest.mark.parametrize("line", [b"strict: true", b"strict:true  # ask", b"strict : TRUE\r", b"strict:\tTrue"])
def test_the_raw_strict_line_forms(tmp_path: Path, line: bytes) -> None:
    broken = write(tmp_path / "t.yaml", b"version: 1\n" + line + b"\nrules: [}\n")
    assert Registry.build(env={"QUANTREG_CONFIG": str(broken), "QUANTREG_PLUGINS": ""}).mode().strict


def test_a_plugin_table_cannot_ask_for_strict_even_through_raw_text(plugin_site: PluginSite) -> None:
    add(plugin_site, "stricty", """
import quantreg
from pathlib import Path

@quantreg.hookimpl
def register_tables(register):
    register(Path(__file__).with_name("stricty.yaml"))
""", **{"stricty.yaml": "version: 1\nstrict: true\nrules: [}\n"})
    registry = Registry.build(env={"QUANTREG_PLUGINS": "stricty"})
    assert registry.problems and not registry.mode().strict


# -- class 8: QUANTREG_* settings ---------------------------------------------------------------

@pytest.mark.parametrize("raw,seconds", [("inf", threading.TIMEOUT_MAX), ("1e308", threading.TIMEOUT_MAX),
                                         ("0.5", 0.5), (" 3 ", 3.0), ("1e-9", 0.01), ("", DEFAULT_PROBE_TIMEOUT)])
def test_timeouts_are_clamped_to_what_threading_allows(raw: str, seconds: float) -> None:
    assert read_seconds({"QUANTREG_PROBE_TIMEOUT": raw}, "QUANTREG_PROBE_TIMEOUT", 10.0) == (seconds, None)


@pytest.mark.parametrize("raw", ["nan", "-1", "0", "abc", "-inf", "1,5"])
def test_unreadable_timeouts_are_located_problems(raw: str) -> None:
    value, problem = read_seconds({"QUANTREG_PROBE_TIMEOUT": raw}, "QUANTREG_PROBE_TIMEOUT", 10.0)
    assert value == 10.0 and problem is not None
    assert str(problem) == (f"environment: QUANTREG_PROBE_TIMEOUT: {raw!r} is not a positive number of seconds "
                            "(e.g. 10, 0.5, inf); using the default 10")


def test_an_infinite_timeout_does_not_overflow_in_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTREG_PROBE_TIMEOUT", "inf")
    assert probe_timeout() == threading.TIMEOUT_MAX
    probed = quantreg.Method(name="probed", target="qrt_x:Y", probe=lambda: (True, "here"))
    registry = Registry.build(env={"QUANTREG_PROBE_TIMEOUT": "inf"}, entry_points=False,
                              plugins=[("p", _Registers(probed))])
    assert registry.availability("probed", "cpu").ok and registry.faults == ()
    assert run_probe(lambda: (True, "fast"), math.inf).ok  # callers passing inf directly are clamped too


@pytest.mark.parametrize("raw,strict,problem", [
    ("1", True, False), (" TRUE ", True, False), ("yes", True, False), ("On", True, False),
    ("0", False, False), ("false", False, False), ("", False, False), ("off", False, False), ("No", False, False),
    ("2", True, True), ("maybe", True, True), ("strict", True, True)])
def test_quantreg_strict_values(raw: str, strict: bool, problem: bool) -> None:
    registry = Registry.build(env={"QUANTREG_STRICT": raw}, entry_points=False)
    assert registry.mode().strict is strict
    found = [str(p) for p in registry.problems]
    assert found == ([f"environment: QUANTREG_STRICT: {raw!r} is not one of 1, true, yes, on (strict) or "
                      "0, false, no, off (lenient); counted as strict"] if problem else [])


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("raw", ["inf", "nan", "abc"])
def test_timeout_settings_through_register_and_the_cli(raw: str, strict: bool) -> None:
    extra = {"QUANTREG_PROBE_TIMEOUT": raw, **({"QUANTREG_STRICT": "1"} if strict else {})}
    out, data = register_child(None, **extra)
    problem = raw != "inf"
    if strict and problem:
        assert out.returncode == 3 and "environment: QUANTREG_PROBE_TIMEOUT: " in data["message"]
    else:
        assert data["raised"] is None
        assert data["faults"] == ([f"environment: QUANTREG_PROBE_TIMEOUT: {raw!r} is not a positive number of "
                                   "seconds (e.g. 10, 0.5, inf); using the default 10"] if problem else [])
        if problem:
            assert "(the default is used)" in out.stderr
    answer = cli("explain", "fp8", "llama", "cpu", "--json", **extra)
    assert "Traceback" not in answer.stderr and answer.returncode == (1 if strict and problem else 0)
    assert len(json.loads(answer.stdout)["problems"]) == int(problem)


def test_mxfp4_compile_setting_is_checked_at_load() -> None:
    registry = Registry.build(env={"QUANTREG_MXFP4_COMPILE": "fast"}, entry_points=False)
    assert [str(p) for p in registry.problems] == [
        "environment: QUANTREG_MXFP4_COMPILE: 'fast' is not one of auto, 0, 1"]
    assert Registry.build(env={"QUANTREG_MXFP4_COMPILE": " Auto "}, entry_points=False).problems == ()


# -- class 9: the CLI says what start-up will do ------------------------------------------------------

@pytest.fixture
def broken_user(tmp_path: Path) -> Path:
    return write(tmp_path / "broken.yaml", "version: 1\nrules:\n  - {match: {device: cpu}, method: nope}\n")


@pytest.mark.parametrize("args", [["list"], ["rules"], ["explain", "fp8", "llama", "cpu"], ["plugins"]])
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_strict_cli_answers_and_says_vllm_would_refuse(broken_user: Path, args: list[str],
                                                       json_flag: list[str]) -> None:
    out = cli(*args, *json_flag, QUANTREG_CONFIG=str(broken_user), QUANTREG_STRICT="1")
    assert out.returncode == 1, out.stdout + out.stderr
    [refusal] = [line for line in out.stderr.splitlines() if line.startswith("vLLM would refuse to start")]
    assert refusal == (f"vLLM would refuse to start (QUANTREG_STRICT=1): {broken_user}:3: rules[0].method: "
                       "unknown method 'nope' (registered: vllm)")
    if json_flag:
        data = json.loads(out.stdout)
        assert data["vllm_would_refuse"] == refusal
        assert [p["text"] for p in data["problems"]] == [refusal.split("): ", 1)[1]]
    else:
        assert out.stdout.strip()  # the rest is still printed


@pytest.mark.parametrize("args", [["list"], ["rules"], ["explain", "fp8", "llama", "cpu"], ["plugins"]])
def test_lenient_cli_shows_the_left_out_file_inline(broken_user: Path, args: list[str]) -> None:
    out = cli(*args, QUANTREG_CONFIG=str(broken_user))
    assert out.returncode == 0, out.stderr
    assert f"  user    {broken_user} LEFT OUT: 1 problem" in out.stdout.splitlines()
    data = json.loads(cli(*args, "--json", QUANTREG_CONFIG=str(broken_user)).stdout)
    assert data["left_out"] == [{"path": str(broken_user), "layer": "user", "problems": 1}]
    assert data["vllm_would_refuse"] is None and len(data["problems"]) == 1


def test_a_strict_chain_with_nothing_available_refuses_in_explain(tmp_path: Path) -> None:
    table = write(tmp_path / "t.yaml", """
        version: 1
        strict: true
        allow_import_targets: true
        methods:
          hpu_only: {target: "qrt_x:Y", devices: hpu}
        rules:
          - {match: {device: cpu}, method: hpu_only}
    """)
    out = cli("explain", "fp8", "llama", "cpu", QUANTREG_CONFIG=str(table))
    assert out.returncode == 1, out.stderr
    [refusal] = [line for line in out.stderr.splitlines() if line.startswith("vLLM would refuse")]
    assert refusal.startswith(f"vLLM would refuse to start (strict: true in {table}): ")
    assert refusal.endswith("(at the first layer with this key)")
    assert cli("explain", "fp8", "llama", "hpu", QUANTREG_CONFIG=str(table)).returncode == 0


PRINTER = """
import quantreg
print("hello from import")

def probe():
    print("hello from the probe")
    return True, "fine"

@quantreg.hookimpl
def register_methods(register):
    print("hello from the hook")
    register(quantreg.Method(name="printer_m", target="qrt_x:Y", probe="qrt_printer:probe"))
"""


@pytest.mark.parametrize("args", [["list", "--device", "cpu"], ["rules"], ["plugins"], ["validate"],
                                  ["explain", "fp8", "llama", "cpu"]])
def test_stdout_stays_json_when_a_plugin_prints(plugin_site: PluginSite, args: list[str]) -> None:
    add(plugin_site, "printer", PRINTER)
    out = cli(*args, "--json", site=plugin_site, plugins="printer")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["problems"] == []
    assert "hello from import" in out.stderr and "hello from the hook" in out.stderr
    if args[0] == "list":
        assert "hello from the probe" in out.stderr


def test_register_keeps_vllms_stdout_clean_when_a_plugin_prints(plugin_site: PluginSite) -> None:
    add(plugin_site, "printer", PRINTER)
    out, data = register_child(plugin_site, "printer")
    assert out.stdout.strip().splitlines() == [json.dumps(data)]  # nothing but the child's own line
    assert "hello from import" in out.stderr and "printer_m" in data["methods"]


def test_the_lenient_warning_says_the_file_is_left_out_whole(broken_user: Path) -> None:
    out, data = register_child(None, QUANTREG_CONFIG=str(broken_user))
    assert data["raised"] is None
    assert (f"quantreg: {broken_user}:3: rules[0].method: unknown method 'nope' (registered: vllm) "
            "(this file is left out whole; the other tables stay in force)") in out.stderr
    assert "ignored; the rest of the table" not in out.stderr


@pytest.mark.vllm
def test_doctor_in_strict_mode_refuses_and_still_reports(broken_user: Path) -> None:
    out = cli("doctor", "--json", QUANTREG_CONFIG=str(broken_user), QUANTREG_STRICT="1")
    assert out.returncode == 1, out.stderr[-2000:]
    data = json.loads(out.stdout)
    assert data["strict"] is True and data["vllm_would_refuse"].startswith("vLLM would refuse to start")
    assert data["left_out"] == [{"path": str(broken_user), "layer": "user", "problems": 1}]
    text = cli("doctor", QUANTREG_CONFIG=str(broken_user))
    assert text.returncode == 0 and f"  user    {broken_user} LEFT OUT: 1 problem" in text.stdout


# -- class 10 (rest): every problem has a line --------------------------------------------------------

def test_a_method_defined_in_two_user_tables_is_located(tmp_path: Path) -> None:
    spec = "allow_import_targets: true\nmethods:\n  twin:\n    target: qrt_x:Y\nrules: []\n"
    a = write(tmp_path / "a.yaml", "version: 1\n" + spec)
    b = write(tmp_path / "b.yaml", "version: 1\n# another comment line\n" + spec)
    registry = Registry.build(env={"QUANTREG_CONFIG": f"{a}{os.pathsep}{b}", "QUANTREG_PLUGINS": ""})
    [problem] = registry.problems
    assert str(problem) == f"{b}:5: methods.twin: method 'twin' is already registered by 'table {a}'"


# -- acceptance property: a grammar of plugin misbehaviours ---------------------------------------------

ERRORS = ["ValueError('v')", "RuntimeError('r')", "SystemExit(0)", "SystemExit('s')", "GeneratorExit()",
          "Halt('h')", "BadStr()", "ImportError('i')", "MemoryError()", "RecursionError()"]
GARBAGE = [expr for expr, _ in BAD_METHODS.values()] + ["None", "'a string'", "42",
                                                         "quantreg.Method(name='vllm', target='qrt_x:Y')"]
TABLE_GARBAGE = ["42", "None", "b'bytes'", "Path(__file__).with_name('missing{i}.yaml')"]

Action = tuple[str, str]
action = st.one_of(
    st.tuples(st.just("good"), st.just("")),
    st.tuples(st.just("garbage"), st.sampled_from(GARBAGE)),
    st.tuples(st.just("print"), st.just("")),
    st.tuples(st.just("sleep"), st.just("")),
)
ending = st.one_of(st.none(), st.tuples(st.just("raise"), st.sampled_from(ERRORS)),
                   st.tuples(st.just("exit"), st.just("")), st.tuples(st.just("return"), st.just("[1]")))
hook = st.tuples(st.lists(action, max_size=3), ending)
plugin = st.tuples(st.one_of(st.none(), st.sampled_from(["raise", "exit", "print", "sleep"])),
                   st.sampled_from(ERRORS), st.one_of(st.none(), hook), st.one_of(st.none(), hook))

_counter = itertools.count()


def plugin_source(name: str, spec: tuple[Any, ...]) -> tuple[str, int, list[str]]:
    """Source of one drawn plugin, how many faults it should cause, and the methods it should keep."""
    at_import, import_error, methods_hook, tables_hook = spec
    lines = [HOOK_PRELUDE, "from pathlib import Path", "import time", "import sys"]
    if at_import == "raise":
        lines.append(f"raise {import_error}")
    elif at_import == "exit":
        lines.append("sys.exit(4)")
    elif at_import == "print":
        lines.append("print('noise at import')")
    elif at_import == "sleep":
        lines.append("time.sleep(0.01)")
    if at_import in ("raise", "exit"):
        return "\n".join(lines) + "\n", 1, []
    expected, kept = 0, []
    for hook_name, hook_spec, bad in (("register_methods", methods_hook, GARBAGE),
                                      ("register_tables", tables_hook, TABLE_GARBAGE)):
        if hook_spec is None:
            continue
        actions, end = hook_spec
        body, hook_faults, hook_kept = [], 0, []
        for i, (kind, arg) in enumerate(actions):
            if kind == "good" and hook_name == "register_methods":
                method = f"{name}_m{i}"
                body.append(f"register(quantreg.Method(name={method!r}, target='qrt_x:Y'))")
                hook_kept.append(method)
            elif kind == "garbage":
                # a missing table per plugin and action: one path named twice would be one table, one fault
                item = arg if hook_name == "register_methods" else bad[len(arg) % len(bad)].format(i=f"{name}_{i}")
                body.append(f"register({item})")
                hook_faults += 1
            elif kind == "print":
                body.append("print('noise in a hook')")
            elif kind == "sleep":
                body.append("time.sleep(0.01)")
        if end is not None and end[0] in ("raise", "exit"):
            body.append(f"raise {end[1]}" if end[0] == "raise" else "sys.exit(0)")
            hook_faults, hook_kept = 1, []  # all or nothing per (plugin, hook) call
        elif end is not None:
            body.append(f"return {end[1]}")
            hook_faults += 1
        lines += ["", "@quantreg.hookimpl", f"def {hook_name}(register):", *(f"    {b}" for b in body or ["pass"])]
        expected += hook_faults
        kept += hook_kept
    return "\n".join(lines) + "\n", expected, kept


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(plugins=st.lists(plugin, min_size=1, max_size=3))
def test_property_every_misbehaviour_is_one_fault_lenient_and_one_error_strict(plugins: list[Any]) -> None:
    import quantreg.vllm as qv

    run = next(_counter)
    with tempfile.TemporaryDirectory() as root, _on_sys_path(root):
        site = PluginSite(Path(root))
        names, expected, kept = [], 0, []
        for i, spec in enumerate(plugins):
            name = f"p{run}x{i}"
            source, n, k = plugin_source(f"qrt_{name}", spec)
            site.add(f"qrt-{name}", {name: f"qrt_{name}"}, modules={f"qrt_{name}": source})
            names.append(name)
            expected += n
            kept += k
        env = {"QUANTREG_PLUGINS": ",".join(names)}
        captured = io.StringIO()
        with redirect_stdout(captured):
            registry = Registry.build(env=env)
        assert captured.getvalue() == ""  # plugin prints went to stderr
        assert len(registry.faults) == expected, (faults(registry), plugins)
        assert all(isinstance(f, (PluginFailure, Problem)) for f in registry.faults)
        assert set(kept) <= set(registry.methods)
        with _environ({**env, "QUANTREG_STRICT": "0"}):
            try:
                with redirect_stdout(captured):
                    qv.register()  # lenient: returns whatever the plugins did
                assert captured.getvalue() == ""
            finally:
                qv.unregister()
        with _environ({**env, "QUANTREG_STRICT": "1"}):
            try:
                if expected:
                    with pytest.raises(QuantregError) as info:
                        qv.register()
                    assert "\n" not in str(info.value) and str(info.value).startswith("quantreg (strict): ")
                else:
                    qv.register()
            finally:
                qv.unregister()
        for module in [m for m in sys.modules if m.startswith(f"qrt_p{run}x")]:
            del sys.modules[module]


@contextmanager
def _on_sys_path(root: str) -> Iterator[None]:
    sys.path.insert(0, root)
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path.remove(root)
        importlib.invalidate_caches()


@contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_plugins_manager_alone_contains_a_hook_raising_system_exit() -> None:
    class Quits:
        @quantreg.hookimpl
        def register_tables(self, register: Any) -> None:
            raise SystemExit(9)

    plugins = Plugins({}, entry_points=False)
    plugins.add(Quits(), "quits")
    # only the built-in plugin's default table is left (it registers through the same hook)
    assert [name for name, _ in plugins.call_each("register_tables")] == ["quantreg.builtin"]
    assert [str(f) for f in plugins.failures] == ["plugin 'quits', hook 'register_tables': raised SystemExit: 9"]
    assert decide_mode({}, ()).strict is False
