"""What plugins' hooks do wrong, contained by quantreg.hookcall (issue 21 class 4), from
test_containment_plugins.py (issue 12, plugin and start-up classes; issue 24 class 5): classes 1, 5
and 6 (a BaseException at import or in a hook, a method field of the wrong type, a hook returning
instead of registering, a path that cannot be read, slow imports) and the property over a grammar of
misbehaviours: every one is one fault when lenient and one error when strict.

Plugins here are real distributions on disk (core_support.PluginSite) or real child processes.
"""

from __future__ import annotations

import importlib
import io
import itertools
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from core_support import (
    BAD_METHODS,
    GOOD_METHODS,
    HOOK_FAULTS,
    HOOK_PRELUDE,
    IMPORT_FAULTS,
    PluginSite,
    _Registers,
    add,
    faults,
    hook_plugin,
    register_child,
    run_quantreg,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import quantreg
from quantreg import Key, Registry
from quantreg.mode import decide_mode
from quantreg.plugins import PluginFailure, Plugins
from quantreg.problems import Problem, QuantregError

# -- from test_containment_plugins.py (issue 12, plugin and start-up classes) -----------------


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("kind", sorted(IMPORT_FAULTS))
def test_base_exception_at_import_is_a_plugin_fault(plugin_site: PluginSite, kind: str) -> None:
    source, expected = IMPORT_FAULTS[kind]
    add(plugin_site, "bad", source)
    add(plugin_site, "fine", GOOD_METHODS)
    registry = Registry.build(env={"QUANTREG_PLUGINS": "bad,fine"})
    [fault] = registry.failures
    assert fault.plugin == "bad" and fault.hook == "" and expected in fault.message, fault
    assert "good_one" in registry.methods  # the other plugin is untouched


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("kind", sorted(HOOK_FAULTS))
def test_base_exception_in_a_hook_is_a_plugin_fault(plugin_site: PluginSite, kind: str) -> None:
    body, expected = HOOK_FAULTS[kind]
    add(plugin_site, "bad", hook_plugin(body))
    registry = Registry.build(env={"QUANTREG_PLUGINS": "bad"})
    assert faults(registry) == [f"plugin 'bad', hook 'register_methods': {expected}"]
    assert "staged_then_lost" not in registry.methods  # all or nothing per (plugin, hook) call


@pytest.mark.usefixtures("clean_env")
def test_keyboard_interrupt_still_stops_a_stuck_start_up(plugin_site: PluginSite) -> None:
    add(plugin_site, "ctrlc", hook_plugin("raise KeyboardInterrupt"))
    with pytest.raises(KeyboardInterrupt):
        Registry.build(env={"QUANTREG_PLUGINS": "ctrlc"})


@pytest.mark.usefixtures("clean_env")
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
    list_out = run_quantreg("list", "--json", "--device", "pu", site=plugin_site, plugins="sloppy")
    assert list_out.returncode == 0 and "Traceback" not in list_out.stderr
    assert [p["text"] for p in json.loads(list_out.stdout)["problems"]] == faults(registry)


@pytest.mark.usefixtures("clean_env")
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


@pytest.mark.usefixtures("clean_env")
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


@pytest.mark.usefixtures("clean_env")
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


@pytest.mark.usefixtures("clean_env")
def test_str_subclasses_are_stored_as_plain_strings() -> None:
    class Touchy(str):
        def __lt__(self, other: object) -> bool:
            raise RuntimeError("do not sort me")

        __hash__ = str.__hash__

    registry = Registry.build(env={}, entry_points=False, plugins=[("touchy", _Registers(
        quantreg.Method(name=Touchy("touchy_m"), target=Touchy("qrt_x:Y"))))])
    assert type(registry.methods["touchy_m"].name) is str and type(registry.methods["touchy_m"].target) is str
    assert len(registry.fingerprint()) == 16  # sorting inside fingerprint() no longer meets the override


@pytest.mark.usefixtures("clean_env")
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
    fast = run_quantreg("list", site=plugin_site, plugins="slow")
    assert "still loading plugin 'slow'" in fast.stderr and fast.returncode == 0


@pytest.mark.usefixtures("clean_env")
def test_fast_plugins_log_nothing(plugin_site: PluginSite) -> None:
    add(plugin_site, "fast", GOOD_METHODS)
    out, data = register_child(plugin_site, "fast")
    assert data["faults"] == [] and "quantreg: still" not in out.stderr and " took " not in out.stderr


ERRORS = ["ValueError('v')", "RuntimeError('r')", "SystemExit(0)", "SystemExit('s')", "GeneratorExit()",
          "Halt('h')", "BadStr()", "ImportError('i')", "MemoryError()", "RecursionError()"]


GARBAGE = [expr for expr, _ in BAD_METHODS.values()] + ["None", "'a string'", "42",
                                                         "quantreg.Method(name='vllm', target='qrt_x:Y')"]


TABLE_GARBAGE = ["42", "None", "b'bytes'", "Path(__file__).with_name('missing{i}.yaml')"]


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


@pytest.mark.usefixtures("clean_env")
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
        with mock.patch.dict(os.environ, {**env, "QUANTREG_STRICT": "0"}):
            try:
                with redirect_stdout(captured):
                    qv.register()  # lenient: returns whatever the plugins did
                assert captured.getvalue() == ""
            finally:
                qv.unregister()
        with mock.patch.dict(os.environ, {**env, "QUANTREG_STRICT": "1"}):
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


@pytest.mark.usefixtures("clean_env")
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
