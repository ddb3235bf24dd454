"""quantreg.hookcall: one caller for every hook and every plugin-supplied callable (issue 21 class 4).

The misbehaviour grammar runs over EVERY hook declared in quantreg.hookspecs (enumerated, not
listed here) and every callable field of every type a hook registers (found from the types'
annotations), so a new hook or a new callable field is covered by being declared.

What real installed plugins' hooks do wrong (issue 12 classes 1, 5 and 6, and the property over a
grammar of misbehaviours) is in test_hookcall_plugin_faults.py.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from core_support import (
    QUANTREG_VARS,
)
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import quantreg
from quantreg import Key, Registry, hookcall, hookspecs
from quantreg.findings import Finding
from quantreg.plugins import PluginFailure, Plugins
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
