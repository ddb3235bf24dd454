"""quantreg.hookcall: one caller for every hook and every plugin-supplied callable (issue 21 class 4).

The misbehaviour grammar runs over EVERY hook declared in quantreg.hookspecs (enumerated, not
listed here) and every callable field of every type a hook registers (found from the types'
annotations), so a new hook or a new callable field is covered by being declared.

Also here (issue 24 class 5, tests by module): what plugins' hooks do wrong, from
test_containment_plugins.py (issue 12, plugin and start-up classes) (classes 1, 5 and 6, and the
property over a grammar of misbehaviours).
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import typing
from collections.abc import Callable, Iterator
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
    QUANTREG_VARS,
    PluginSite,
    _Registers,
    add,
    faults,
    hook_plugin,
    register_child,
    run_quantreg,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import quantreg
from quantreg import Key, Registry, hookcall, hookspecs
from quantreg.findings import Finding
from quantreg.mode import decide_mode
from quantreg.plugins import PluginFailure, Plugins
from quantreg.problems import Problem, QuantregError
from quantreg.vllm_limits import VllmLimitation, vllm_backend_note

HOOKS = hookspecs.hook_names()


class Halt(BaseException):
    """A custom BaseException subclass: plugin code may raise anything."""


RAISES: list[Callable[[], BaseException]] = [lambda: ValueError("v"), lambda: SystemExit(0), lambda: SystemExit(3),
                                             lambda: GeneratorExit(), lambda: Halt("h"), lambda: MemoryError(),
                                             lambda: RecursionError()]


def good_item(hook: str, i: int) -> Any:
    """A valid item for ``hook``'s register(), built from the declared type."""
    hint = hookspecs.registered_type(hook)
    examples: dict[Any, Any] = {
        quantreg.Method: quantreg.Method(name=f"hc_m{i}", target="qrt_x:Y"),
        VllmLimitation: VllmLimitation(reason=f"r{i}", device="npu"),
        Finding: Finding("info", f"f{i}"),
    }
    if hint in examples:
        return examples[hint]
    if isinstance(hint, type) and hint.__name__ == "QuantConfigKeeper":
        return hint(name=f"k{i}", quant_method="mxfp4", quant_format="f", model_type="m", module="a.b",
                    target="a.b:c")
    return f"/nonexistent/hc{i}.yaml"  # register_tables: a path (reading it is the loader's business)


def bad_field_items(hook: str) -> list[Any]:
    """The valid item with each annotated dataclass field replaced by a value of the wrong type."""
    item = good_item(hook, 0)
    if not dataclasses.is_dataclass(item) or hook in hookcall.FIELDS_CHECKED_BY:
        return []
    hints = typing.get_type_hints(type(item))
    out = []
    for f in dataclasses.fields(item):
        for wrong in (5, None, object()):
            if not hookcall.conforms(wrong, hints[f.name]):
                out.append(dataclasses.replace(item, **{f.name: wrong}))
                break
    return out


def test_the_grammar_knows_every_declared_hook() -> None:
    assert set(HOOKS) >= {"register_methods", "register_tables", "register_quant_config_keepers",
                          "doctor_findings", "register_vllm_limitations"}
    for hook in HOOKS:
        assert hookcall.value_problem(good_item(hook, 0), hookspecs.registered_type(hook)) is None, hook


Misbehaviour = tuple[str, int]
MISBEHAVIOUR = st.one_of(st.tuples(st.just("raise"), st.integers(0, len(RAISES) - 1)),
                         st.tuples(st.just("wrong_type"), st.integers(0, 3)),
                         st.tuples(st.just("bad_field"), st.integers(0, 20)),
                         st.tuples(st.just("return"), st.integers(0, 2)),
                         st.tuples(st.just("good"), st.integers(0, 3)))


def make_plugin(hook: str, script: list[Misbehaviour]) -> tuple[object, int, int]:
    """A plugin object implementing ``hook`` (with every declared argument) and the faults/items it should cause."""
    wrong = ["a string", 42, None, b"bytes"]
    faults, kept = 0, 0
    actions: list[Callable[[Callable[[Any], None]], Any]] = []
    bad_fields = bad_field_items(hook)
    for kind, n in script:
        if kind == "raise":
            actions.append(lambda register, n=n: (_ for _ in ()).throw(RAISES[n]()))
            faults, kept = 1, 0  # all or nothing per call; later actions never run
            break
        if kind == "wrong_type" and not (hook == "register_tables" and isinstance(wrong[n], str)):
            actions.append(lambda register, n=n: register(wrong[n]))
            faults += 1
        elif kind == "bad_field" and bad_fields:
            actions.append(lambda register, n=n: register(bad_fields[n % len(bad_fields)]))
            faults += 1
        elif kind == "return":
            actions.append(lambda register, n=n: [n])
            faults += 1
            break
        elif kind == "good":
            actions.append(lambda register, n=n: register(good_item(hook, n)))
            kept += 1
    params = ", ".join(hookspecs.hook_argnames(hook))
    namespace: dict[str, Any] = {"actions": actions, "quantreg": quantreg}
    exec(textwrap_hook(hook, params), namespace)  # a hook with the declared signature, as a plugin writes it
    return type("P", (), {hook: staticmethod(namespace[hook])})(), faults, kept


def textwrap_hook(hook: str, params: str) -> str:
    return (f"@quantreg.hookimpl\ndef {hook}({params}):\n    out = None\n    for act in actions:\n"
            "        out = act(register)\n    return out\n")


@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(HOOKS), st.lists(st.lists(MISBEHAVIOUR, max_size=4), min_size=1, max_size=3))
def test_every_hook_contains_every_misbehaviour(hook: str, scripts: list[list[Misbehaviour]]) -> None:
    registry = Registry.build(env={"QUANTREG_CACHE_DIR": "off"}, entry_points=False)
    pl = Plugins(env={}, entry_points=False)
    expected_faults, expected_items = {}, {}
    for i, script in enumerate(scripts):
        plugin, faults, kept = make_plugin(hook, script)
        pl.add(plugin, f"p{i}")
        expected_faults[f"p{i}"], expected_items[f"p{i}"] = faults, kept
    before = len(pl.failures)
    items = pl.call_each(hook, registry=registry, device="cpu")  # never raises, SystemExit included
    failures = pl.failures[before:]
    hint = hookspecs.registered_type(hook)
    for name in expected_faults:
        assert sum(f.plugin == name for f in failures) == expected_faults[name], (name, failures)
        mine = [item for plugin, item in items if plugin == name]
        assert len(mine) == expected_items[name] and all(hookcall.value_problem(x, hint) is None for x in mine)
    assert all("\n" not in str(f) for f in failures)
    inline = pl.call_each(hook, inline_failures=True, registry=registry, device="cpu")
    assert sum(isinstance(x, PluginFailure) for _, x in inline) == sum(expected_faults.values())


def callable_fields() -> list[tuple[type, str]]:
    """Every field, of every type a hook registers, whose annotation admits a callable (plugin code)."""
    found = []
    for hook in HOOKS:
        hint = hookspecs.registered_type(hook)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            for name, field_hint in typing.get_type_hints(hint).items():
                if hookcall.conforms(lambda: None, field_hint) and name != "plugin":
                    found.append((hint, name))
    return found


def test_callable_fields_are_found() -> None:
    assert (VllmLimitation, "applies") in callable_fields()


BAD_CALLS: list[Callable[[], Any]] = [lambda: sys.exit(0), lambda: (_ for _ in ()).throw(Halt()), lambda: 1,
                                      lambda: "yes", lambda: None, lambda: (_ for _ in ()).throw(ValueError())]


@pytest.mark.parametrize("field", [f"{t.__name__}.{n}" for t, n in callable_fields()])
@pytest.mark.parametrize("bad", range(len(BAD_CALLS)))
def test_every_plugin_supplied_callable_is_contained(field: str, bad: int) -> None:
    """``applies`` calling sys.exit(0) used to end ``explain --json`` silently with status 0."""
    assert field in CONSUMERS, f"{field}: a new callable field needs its consumer in CONSUMERS"
    CONSUMERS[field](BAD_CALLS[bad])


def _applies(fn: Callable[[], Any]) -> None:
    lim = VllmLimitation(reason="r", device="cpu", applies=fn, plugin="p")
    assert lim.holds() is False  # contained, and only a real True applies
    assert vllm_backend_note(Key("f", "m", "cpu"), [lim]) is None


def _probe(fn: Callable[[], Any]) -> None:
    method = quantreg.Method(name="hc_probe", target="qrt_x:Y", probe=fn)
    availability = method.availability("cpu")
    assert availability.ok is False and "\n" not in availability.reason


CONSUMERS: dict[str, Callable[[Callable[[], Any]], None]] = {
    "VllmLimitation.applies": _applies, "Method.probe": _probe}


def test_the_issue_examples_are_faults_not_tracebacks() -> None:
    class Bad:
        @quantreg.hookimpl
        def register_vllm_limitations(self, register: Any) -> None:
            register(VllmLimitation(reason="r", device=None))  # type: ignore[arg-type]

        @quantreg.hookimpl
        def doctor_findings(self, register: Any) -> None:
            register(Finding("info", "m", key=5))  # type: ignore[arg-type]

    registry = Registry.build(env={"QUANTREG_CACHE_DIR": "off"}, entry_points=False, plugins=[("bad", Bad())])
    from quantreg.loading import collect_findings, plugin_limitations

    found, faults = plugin_limitations(registry.plugins)
    assert found == [] and faults == ["plugin 'bad', hook 'register_vllm_limitations': VllmLimitation.device must "
                                      "be str | tuple[str, ...], got None (NoneType)"]
    [finding] = collect_findings(registry.plugins, registry.resolve, "cpu")
    assert finding.level == "error" and "Finding.key must be quantreg.keys.Key | None, got 5" in finding.message
    assert finding.as_json()["key"] is None


def test_a_blocking_call_is_named_while_it_blocks_and_bounded(caplog: pytest.LogCaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hookcall, "SLOW_SECONDS", 0.05)
    with caplog.at_level("WARNING", logger="vllm.quantreg"):
        started = time.monotonic()
        result, error = hookcall.call("checking 'applies' of plugin 'slowpoke'", lambda: time.sleep(5), timeout=0.3)
    assert time.monotonic() - started < 3
    assert result is None and error is not None and "did not finish within 0.3 s" in error
    assert any("still checking 'applies' of plugin 'slowpoke'" in r.getMessage() for r in caplog.records)


def test_keyboard_interrupt_passes() -> None:
    def stop() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        hookcall.call("x", stop)


def test_a_plugin_import_that_blocks_is_dropped_after_the_setting(plugin_site: Any) -> None:
    """A 30 s import: dropped after QUANTREG_PLUGIN_IMPORT_TIMEOUT, a warning naming it, the rest goes on."""

    plugin_site.add("sleepy", {"sleepy": "qrt_sleepy"}, {"qrt_sleepy": "import time\ntime.sleep(30)\n"})
    code = ("import time; t = time.monotonic()\nfrom quantreg.registry import Registry\n"
            "r = Registry.build()\nprint('SECONDS', round(time.monotonic() - t, 1))\n"
            "print('FAULTS', [str(f) for f in r.failures])")
    env = {k: v for k, v in plugin_site.env().items() if k not in QUANTREG_VARS}
    env.update(QUANTREG_PLUGINS="sleepy", QUANTREG_PLUGIN_IMPORT_TIMEOUT="1", QUANTREG_CACHE_DIR="off")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env,
                         cwd=Path(__file__).parent)
    assert out.returncode == 0, out.stderr[-2000:]
    seconds = float(out.stdout.split("SECONDS", 1)[1].split()[0])
    assert seconds < 10, out.stdout
    assert "plugin 'sleepy'" in out.stdout and "did not finish within 1 s" in out.stdout


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
