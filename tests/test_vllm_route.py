"""quantreg.vllm.route: the one route both seams share, and every plugin method built behind hookcall.call.

Real parts: plugin method classes in a real module on ``sys.path`` (imported by ``Method.load`` as in
a vLLM process), a real registry from a real table and a registered plugin, the log of the
``vllm.quantreg`` logger. No vLLM needed: the base class check is given a plain class.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import quantreg
from quantreg import Key, QuantregError, Registry
from quantreg.methods import BuildContext, Method
from quantreg.vllm.route import BuildFailed, Route, build

METHODS = '''
import sys
from quantreg.problems import strict_error

class Base:
    pass

class Exiting(Base):
    def __init__(self, first, **options):
        print("constructor talks on stdout")
        raise SystemExit(3)

class Strict(Base):
    def __init__(self, first, **options):
        raise strict_error("verify: refusing to start")

class Plain:
    def __init__(self, first, **options):
        pass

class Good(Base):
    def __init__(self, first, quantreg_context=None, **options):
        self.first, self.context, self.options = first, quantreg_context, options
'''


@pytest.fixture
def methods(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    (tmp_path / "qrt_route_methods.py").write_text(METHODS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    return importlib.import_module("qrt_route_methods")


def _context(name: str) -> BuildContext:
    return BuildContext(Key("fmt", "model", "cpu"), name, "t.yaml:3", {"chunk": 4}, "model.layers.0.mlp.experts")


def test_a_method_is_built_with_its_context_and_checked_against_the_base(methods: Any) -> None:
    built = build(Method("good", "qrt_route_methods:Good"), "moe_config", _context("good"), methods.Base)
    assert built.first == "moe_config" and built.options == {"chunk": 4} and built.context.method == "good"
    with pytest.raises(BuildFailed, match=r"^TypeError: method 'plain' target qrt_route_methods:Plain does not "
                                          r"subclass vLLM's Base$"):
        build(Method("plain", "qrt_route_methods:Plain"), None, _context("plain"), methods.Base)


def test_plugin_code_is_contained_systemexit_included_and_its_stdout_kept_off_stdout(
        methods: Any, capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(BuildFailed, match=r"^SystemExit: 3$"):
        build(Method("exiting", "qrt_route_methods:Exiting"), None, _context("exiting"), methods.Base)
    out, err = capfd.readouterr()
    assert "constructor talks" not in out and "constructor talks on stdout" in err  # stdout may be a --json answer
    with pytest.raises(BuildFailed, match=r"^ImportError: module 'qrt_route_methods' has no attribute 'Nope'"):
        build(Method("missing", "qrt_route_methods:Nope"), None, _context("missing"), None)


def test_a_strict_line_from_plugin_code_passes_unchanged(methods: Any) -> None:
    with pytest.raises(QuantregError) as raised:
        build(Method("strict", "qrt_route_methods:Strict"), None, _context("strict"), methods.Base)
    assert str(raised.value) == "quantreg (strict): verify: refusing to start"  # never a second prefix


class _Plugin:
    @quantreg.hookimpl
    def register_methods(self, register: Any) -> None:
        register(quantreg.Method(name="exiting", target="qrt_route_methods:Exiting"))


@pytest.mark.parametrize("strict", [False, True])
def test_a_method_that_cannot_be_built_leaves_vllms_own_or_refuses(
        methods: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, strict: bool) -> None:
    table = tmp_path / "t.yaml"
    table.write_text("version: 1\nrules:\n  - match: {quant_format: fmt}\n    method: exiting\n")
    registry = Registry.build(config=[table], env={}, entry_points=False, plugins=[("route_test", _Plugin())])
    decision = registry.resolve(Key("fmt", "model", "cpu"))
    assert decision.method == "exiting", decision
    message = f"method 'exiting' for (fmt, model, cpu) [{table}:3] could not be built for lm_head: SystemExit: 3"
    route = Route()
    if strict:
        with pytest.raises(QuantregError) as raised:
            route.method_or_none(decision, registry, None, "lm_head", None, methods.Base, True, " for lm_head")
        assert str(raised.value) == f"quantreg (strict): {message}"
        return
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg"):
        got = route.method_or_none(decision, registry, None, "lm_head", None, methods.Base, False, " for lm_head")
    assert got is None
    assert f"quantreg: {message}; using vLLM's own method" in [r.getMessage() for r in caplog.records]


def test_both_seams_share_the_processs_one_route() -> None:
    import quantreg.vllm as qv
    from quantreg.vllm.dense import DenseSeam
    from quantreg.vllm.seam import Seam

    assert isinstance(qv._route, Route) and qv._seam.run is qv._route and qv._dense.run is qv._route
    route = Route()
    assert Seam(route).run is route and DenseSeam(route).run is route
    assert Seam().run is not DenseSeam().run  # made alone (tests), each gets its own
