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

class Raises(Base):
    def __init__(self, first, **options):
        raise RuntimeError("cannot build here")

class RaisesQuantregError(Base):
    def __init__(self, first, **options):
        from quantreg import QuantregError
        raise QuantregError("the public error class")

class Boom(BaseException):
    pass

class RaisesBase(Base):
    def __init__(self, first, **options):
        raise Boom("a BaseException of its own")

class RefusesOption(Base):
    def __init__(self, first, precision="q8"):
        if precision != "q8":
            raise ValueError(f"option precision={precision!r} is not one of q8")

class ReturnsNone(Base):
    def __new__(cls, *args, **kwargs):
        return None

class Returns42(Base):
    def __new__(cls, *args, **kwargs):
        return 42

class Plain:
    def __init__(self, first, **options):
        pass

class Good(Base):
    def __init__(self, first, quantreg_context=None, **options):
        self.first, self.context, self.options = first, quantreg_context, options

class ReturnsOther(Base):
    def __new__(cls, first, quantreg_context=None, **options):
        return Good(first, quantreg_context)
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


#: Every way constructing a plugin method can fail or return (issue 53, classes 2 and 4): the class
#: in ``FAILURES`` below, and the one-line text its WARNING / strict line must carry.
FAILURE_KINDS = {
    "raises": ("qrt_route_methods:Raises", "RuntimeError: cannot build here"),
    "quantreg_error": ("qrt_route_methods:RaisesQuantregError", "QuantregError: the public error class"),
    "system_exit": ("qrt_route_methods:Exiting", "SystemExit: 3"),
    "base_exception": ("qrt_route_methods:RaisesBase", "Boom: a BaseException of its own"),
    "option_refused": ("qrt_route_methods:RefusesOption", "ValueError: option precision='q4' is not one of q8"),
    "declared_value": ("qrt_route_methods:Good", "ValueError: method 'declared_value' does not accept option "
                                                 "precision='q4' (accepted: 'q8')"),
    "import": ("qrt_route_methods:Nope", "ImportError: module 'qrt_route_methods' has no attribute 'Nope' "
                                          "(target qrt_route_methods:Nope)"),
    "returns_none": ("qrt_route_methods:ReturnsNone", "TypeError: method 'returns_none' (plugin 'route_test'): "
                     "constructing qrt_route_methods:ReturnsNone returned None, not an instance of ReturnsNone"),
    "returns_42": ("qrt_route_methods:Returns42", "TypeError: method 'returns_42' (plugin 'route_test'): "
                   "constructing qrt_route_methods:Returns42 returned int 42, not an instance of Returns42"),
    "returns_other_method": ("qrt_route_methods:ReturnsOther", "TypeError: method 'returns_other_method' (plugin "
                             "'route_test'): constructing qrt_route_methods:ReturnsOther returned "
                             "qrt_route_methods.Good object, not an instance of ReturnsOther"),
}
LAYERS = ("experts", "dense")


class _Plugin:
    @quantreg.hookimpl
    def register_methods(self, register: Any) -> None:
        for name, (target, _) in FAILURE_KINDS.items():
            register(quantreg.Method(name=name, target=target, options=("precision",), layers=LAYERS,
                                     option_values={"precision": ("q8",)} if name == "declared_value" else None))
        register(quantreg.Method(name="good", target="qrt_route_methods:Good", layers=LAYERS))
        register(quantreg.Method(name="gaudi_only", target="qrt_route_methods:Good", devices=("hpu",), layers=LAYERS))


def _registry(tmp_path: Path, rules: str) -> tuple[Registry, Path]:
    table, empty = tmp_path / "t.yaml", tmp_path / "default.yaml"
    table.write_text("version: 1\nrules:\n" + rules)
    empty.write_text("version: 1\nrules: []\n")  # no shipped catch-all rule: the walk sees only these rules
    registry = Registry.build(config=[table], env={}, entry_points=False, plugins=[("route_test", _Plugin())],
                              default_table=empty)
    assert not registry.faults, registry.faults
    return registry, table


#: Where the walk goes after the failed method: the rest of its rule's chain, the next rule's chain (a
#: method that cannot run here, ``gaudi_only``, passed over as ``explain`` passes it), or, with nothing
#: left, vLLM's own method.
ROUTES = {
    "chain": ("  - match: {{quant_format: fmt, layer: {layer}}}\n"
              "    method: [{bad}, gaudi_only, good]\n"
              "    options: {{precision: q4}}\n", "good", 3),
    "next_rule": ("  - match: {{quant_format: fmt, model_type: model, layer: {layer}}}\n"
                  "    method: [{bad}, gaudi_only]\n"
                  "    options: {{precision: q4}}\n"
                  "  - match: {{quant_format: fmt, layer: {layer}}}\n"
                  "    method: [gaudi_only, good]\n", "good", 6),
    "nothing_left": ("  - match: {{quant_format: fmt, layer: {layer}}}\n"
                     "    method: [{bad}, gaudi_only]\n"
                     "    options: {{precision: q4}}\n", "vllm", None),
}


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("route_kind", sorted(ROUTES))
@pytest.mark.parametrize("kind", sorted(FAILURE_KINDS))
def test_a_method_that_cannot_be_built_continues_down_the_chain_or_refuses(
        methods: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str, route_kind: str, strict: bool,
        layer: str) -> None:
    """Every way construction fails × where the walk goes × lenient/strict × the MoE and dense layer kinds.

    Lenient: exactly one WARNING naming the method, its plugin and the fault, and the method that serves
    instead (the next one known to run, vLLM's own only when none is left); what is returned is that
    method's object and the decision naming it. Strict: one ``quantreg (strict):`` line, nothing built.
    """
    rules, serving, line = ROUTES[route_kind]
    registry, table = _registry(tmp_path, rules.format(bad=kind, layer=layer))
    key = Key("fmt", "model", "cpu", layer)
    decision = registry.resolve(key)
    assert decision.method == kind, decision
    fault = FAILURE_KINDS[kind][1]
    message = (f"method '{kind}' (plugin 'route_test') for {key} [{table}:3] could not be built for x: {fault}")
    route = Route()
    with caplog.at_level(logging.INFO, logger="vllm.quantreg"):
        if strict:
            with pytest.raises(QuantregError) as raised:
                route.method_or_none(decision, registry, "first", "x", None, methods.Base, True, " for x")
            text = str(raised.value)
            assert "\n" not in text and text.startswith("quantreg (strict): ")
            assert text == f"quantreg (strict): {message}"  # plugin code's QuantregError too, named as its fault
            assert not caplog.records
            return
        served, built = route.method_or_none(decision, registry, "first", "x", None, methods.Base, False, " for x")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert served.method == serving
    if serving == "vllm":
        assert built is None
        assert warnings == [f"quantreg: {message}; using vLLM's own method (no other method of the matching rules "
                            "is known to run here)"]
    else:
        assert isinstance(built, methods.Good) and built.context.method == "good"  # the object the decision names
        assert served.source == f"{table}:{line}" and built.context.rule == served.source
        assert warnings == [f"quantreg: {message}; using 'good' [{table}:{line}], the next method known to run here"]


def test_a_chain_whose_next_available_method_is_vllm_hands_the_layer_to_vllm(
        methods: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``vllm`` in the chain, known to run here, ends the walk: vLLM's own method, not a later plugin's."""
    registry, _ = _registry(tmp_path, "  - match: {quant_format: fmt}\n    method: [raises, vllm, good]\n")
    decision = registry.resolve(Key("fmt", "model", "cpu"))
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg"):
        served, built = Route().method_or_none(decision, registry, None, "x", None, methods.Base, False)
    assert (served.method, built) == ("vllm", None)
    assert [r.getMessage().rsplit("; ", 1)[1] for r in caplog.records] == ["using vLLM's own method"]


def test_every_failing_choice_is_named_once_then_vllms_own(methods: Any, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Two methods fail in turn: one WARNING each, each naming what it hands on to."""
    registry, table = _registry(tmp_path, "  - match: {quant_format: fmt}\n    method: [raises, returns_none]\n")
    decision = registry.resolve(Key("fmt", "model", "cpu"))
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg"):
        served, built = Route().method_or_none(decision, registry, None, "x", None, methods.Base, False)
    assert (served.method, built) == ("vllm", None)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "method 'raises'" in lines[0] and lines[0].endswith(f"using 'returns_none' [{table}:3], the next "
                                                               "method known to run here")
    assert "method 'returns_none'" in lines[1] and "using vLLM's own method (no other method" in lines[1]


def test_both_seams_share_the_processs_one_route() -> None:
    import quantreg.vllm as qv
    from quantreg.vllm.dense import DenseSeam
    from quantreg.vllm.seam import Seam

    assert isinstance(qv._route, Route) and qv._seam.run is qv._route and qv._dense.run is qv._route
    route = Route()
    assert Seam(route).run is route and DenseSeam(route).run is route
    assert Seam().run is not DenseSeam().run  # made alone (tests), each gets its own


def test_every_layer_of_a_key_walks_alike_and_the_warning_is_said_once(methods: Any, tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A model has many layers of one key (GPT-OSS 20B: 24 MoE layers): each is built down the same walk,
    and the operator reads one WARNING for the key, as for its decision line."""
    registry, table = _registry(tmp_path, "  - match: {quant_format: fmt}\n    method: [raises, good]\n")
    decision = registry.resolve(Key("fmt", "model", "cpu"))
    route = Route()
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg"):
        built = [route.method_or_none(decision, registry, i, f"model.layers.{i}.mlp.experts", None, methods.Base,
                                      False)[1] for i in range(3)]
    assert [b.first for b in built] == [0, 1, 2] and all(isinstance(b, methods.Good) for b in built)
    assert len(caplog.records) == 1 and f"using 'good' [{table}:3]" in caplog.records[0].getMessage()


@pytest.mark.parametrize("strict", [False, True])
def test_the_boundary_contains_plugin_codes_quantreg_error_when_lenient(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, strict: bool) -> None:
    """The public ``QuantregError`` raised anywhere under a seam (plugin code may raise it too): lenient, one
    WARNING and vLLM's own method; strict, passed on as the one line it already is."""
    from quantreg.registry import set_registry

    monkeypatch.setenv("QUANTREG_STRICT", "1" if strict else "0")
    set_registry(None)

    def work() -> str:
        raise QuantregError("a plugin's own refusal")

    try:
        with caplog.at_level(logging.WARNING, logger="vllm.quantreg"):
            if strict:
                with pytest.raises(QuantregError, match=r"^a plugin's own refusal$"):
                    Route.contained("model.layers.0.mlp.experts", work, lambda: "vllm's")
                return
            assert Route.contained("model.layers.0.mlp.experts", work, lambda: "vllm's") == "vllm's"
    finally:
        set_registry(None)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("vllm.quantreg")] == [
        "quantreg: routing model.layers.0.mlp.experts failed unexpectedly: QuantregError: a plugin's own refusal; "
        "using vLLM's own method"]


def test_the_trail_names_the_method_that_serves(methods: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decision recorded in ``QUANTREG_DECISIONS`` names the method that failed; one ``build_failed``
    event (once per key) names the method that serves instead, so the trail holds what vLLM was handed."""
    import json

    trail = tmp_path / "trail.jsonl"
    monkeypatch.setenv("QUANTREG_DECISIONS", str(trail))
    registry, table = _registry(tmp_path, "  - match: {quant_format: fmt}\n    method: [returns_42, good]\n")
    decision = registry.resolve(Key("fmt", "model", "cpu"))
    route = Route()
    for i in range(2):
        served, built = route.method_or_none(decision, registry, i, "x", None, methods.Base, False)
        assert served.method == "good" and isinstance(built, methods.Good)
    (event,) = [json.loads(line) for line in trail.read_text().splitlines()]
    assert {k: event[k] for k in ("event", "method", "rule", "serving", "serving_rule")} == {
        "event": "build_failed", "method": "returns_42", "rule": f"{table}:3", "serving": "good",
        "serving_rule": f"{table}:3"}
    assert event["error"].startswith("TypeError: method 'returns_42' (plugin 'route_test'): constructing ")


#: A ``tokens:`` split (issue 53 class 2): the decode side (``tokens<=8``) decided by a rule whose first
#: method fails; where its walk goes. The other range's rule (``tokens>8``) is never walked: it does not
#: serve these token counts. ``line`` is the rule that serves the side.
SPLIT_ROUTES = {
    "chain": ('  - match: {{quant_format: fmt, tokens: "<=8"}}\n'
              "    method: [{bad}, gaudi_only, good]\n"
              "    options: {{precision: q4}}\n"
              "  - match: {{quant_format: fmt}}\n"
              "    method: [returns_42]\n", "good", 3),
    "next_rule": ('  - match: {{quant_format: fmt, tokens: "<=8"}}\n'
                  "    method: [{bad}, gaudi_only]\n"
                  "    options: {{precision: q4}}\n"
                  "  - match: {{quant_format: fmt}}\n"
                  "    method: [gaudi_only, good]\n", "good", 6),
    "nothing_left": ('  - match: {{quant_format: fmt, tokens: "<=8"}}\n'
                     "    method: [{bad}, gaudi_only]\n"
                     "    options: {{precision: q4}}\n"
                     '  - match: {{quant_format: fmt, tokens: ">8"}}\n'
                     "    method: [good]\n", "vllm", None),
}
SPLIT_FAILURES = ("raises", "quantreg_error", "returns_none")


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("route_kind", sorted(SPLIT_ROUTES))
@pytest.mark.parametrize("kind", SPLIT_FAILURES)
def test_a_split_side_that_cannot_be_built_continues_down_its_walk_or_refuses(
        methods: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str, route_kind: str,
        strict: bool) -> None:
    """A split side's constructor raises ``Exception`` / ``QuantregError`` or returns ``None``: lenient, one
    WARNING and the side's next method known to run serves it (vLLM's own only when none is left), wrapped
    as the seam wraps it; strict, one ``quantreg (strict):`` line. Before, the side was dropped (or, for
    ``QuantregError``, the whole layer went to vLLM's own method, which GPT-OSS MXFP4 cannot run here)."""
    rules, serving, line = SPLIT_ROUTES[route_kind]
    registry, table = _registry(tmp_path, rules.format(bad=kind))
    key = Key("fmt", "model", "cpu")
    decision = registry.resolve(key)
    assert decision.is_split, decision
    decode, _ = decision.split
    assert (str(decode.tokens), decode.decision.method) == ("<=8", kind)
    fault = FAILURE_KINDS[kind][1]
    message = (f"method '{kind}' (plugin 'route_test') for {key} [{table}:3] could not be built for x (the "
               f"tokens<=8 side of a tokens: split): {fault}")
    route = Route()

    def side(one: Any, tokens: str) -> tuple[Any, Any]:
        return route.split_side(one, tokens, registry, "first", "x", None, methods.Base, strict,
                                lambda: "vLLM's own", lambda method, serving: ("verified", method, serving.method))

    with caplog.at_level(logging.INFO, logger="vllm.quantreg"):
        if strict:
            with pytest.raises(QuantregError) as raised:
                side(decode.decision, str(decode.tokens))
            assert str(raised.value) == f"quantreg (strict): {message}"
            assert not caplog.records
            return
        served, built = side(decode.decision, str(decode.tokens))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert served.method == serving
    if serving == "vllm":
        assert built == "vLLM's own"
        assert warnings == [f"quantreg: {message}; using vLLM's own method (no other method of the matching rules "
                            "is known to run here)"]
    else:
        wrapped, method, name = built
        assert (wrapped, name) == ("verified", "good") and isinstance(method, methods.Good)
        assert served.source == f"{table}:{line}" and method.context.rule == served.source
        assert warnings == [f"quantreg: {message}; using 'good' [{table}:{line}], the next method known to run here"]


def test_a_split_sides_vllm_keeps_vllms_own_without_a_build(methods: Any, tmp_path: Path) -> None:
    """A side decided ``vllm`` is vLLM's own method, asked once, nothing built and nothing said."""
    registry, _ = _registry(tmp_path, '  - match: {quant_format: fmt, tokens: "<=8"}\n    method: [good]\n'
                                      "  - match: {quant_format: fmt}\n    method: [vllm]\n")
    _, prefill = registry.resolve(Key("fmt", "model", "cpu")).split
    asked: list[str] = []
    served, built = Route().split_side(prefill.decision, str(prefill.tokens), registry, None, "x", None,
                                       methods.Base, False, lambda: asked.append("vllm") or "vLLM's own",
                                       lambda method, serving: pytest.fail("nothing is built"))
    assert (served.method, built, asked) == ("vllm", "vLLM's own", ["vllm"])


def test_the_split_names_the_method_that_serves_each_side(methods: Any, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Through ``build_split`` as the MoE seam calls it: the failed decode side is served by the next method of
    its walk, the split keeps both ranges, and its sides name what serves (not what failed)."""
    pytest.importorskip("vllm")
    from quantreg.vllm.token_split import TokenSplitMethod, build_split

    registry, _ = _registry(tmp_path, '  - match: {quant_format: fmt, tokens: "<=8"}\n'
                                      "    method: [quantreg_error, good]\n"
                                      "  - match: {quant_format: fmt}\n    method: [vllm]\n")
    decision = registry.resolve(Key("fmt", "model", "cpu"))
    route = Route()
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg"):
        split = build_split(decision, lambda one, tokens: route.split_side(
            one, tokens, registry, None, "x", None, methods.Base, False, lambda: "vLLM's own",
            lambda method, serving: method), "x", False)
    assert isinstance(split, TokenSplitMethod)
    assert split.quantreg_split == (("<=8", "good"), (">8", "vllm"))
    (line,) = [r.getMessage() for r in caplog.records if r.name.startswith("vllm.quantreg")]
    assert "method 'quantreg_error'" in line and line.endswith("the next method known to run here")
