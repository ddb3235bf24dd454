"""No routed-experts layer slips past the registry (issue 15, deliverable 3).

Real ``RoutedExperts`` subclasses, in real layers built by vLLM's own ``FusedMoEFactory`` through
the kit's harness (``VllmMoeHarness.build_routed``: the model hands ``routed_experts_cls`` to the
factory as vLLM's models do), with quantreg's real seam installed on vLLM's real module:

* an override with ``super()`` is decided by the registry inside the base wrapper;
* an override without ``super()`` (vLLM 0.33's ``MuseSparkRoutedExperts``) is routed too, and
  keeps its own method when the decision is ``vllm``;
* a class defined after the seam was installed is covered as well;
* an override that calls ``super()`` and returns something else gets one WARNING naming the class
  and key; one that raises on the registry's method (0.33's DeepseekV4 heterogeneous experts)
  falls back to vLLM's own method (lenient) or fails (strict);
* a changed signature keeps the seam inactive with one WARNING, instead of breaking builds.

The real-layer tests are in the compat subset (``scripts/compat.sh`` runs them on every release).
"""

from __future__ import annotations

import importlib.util
import logging
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")
MODULE = "vllm.model_executor.layers.fused_moe.routed_experts"
KEY = "(gpt_oss_mxfp4, gpt_oss, cpu)"


class Records(logging.Handler):
    """quantreg's log lines (vLLM's logger setup may stop them from reaching pytest's root handler)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))

    def warnings(self, *words: str) -> list[str]:
        return [m for level, m in self.lines if level == "WARNING" and all(w in m for w in words)]


@pytest.fixture
def records() -> Iterator[Records]:
    logger = logging.getLogger("vllm.quantreg")
    handler, level = Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def install(tmp_path: Path, rules: str, seams: list[Any], strict: bool = False) -> Any:
    """quantreg's seam on vLLM's real module, deciding from a user table with plugin #1's methods
    (the test's earlier seams are removed first; ``seams`` is the ``uninstall`` fixture's list)."""
    import quantreg_hpu_mxfp4.plugin as plugin1
    from vllm.model_executor.layers.fused_moe import routed_experts as module

    import quantreg.vllm as qv
    from quantreg.registry import Registry, set_registry
    from quantreg.vllm.seam import Seam

    for old in seams:
        old.unpatch()
    qv.unregister()  # the process-wide seam, if vLLM's plugin loader registered quantreg in this process
    table = tmp_path / "coverage.yaml"
    table.write_text("version: 1\nrules:\n" + rules)
    env = {"QUANTREG_STRICT": "1"} if strict else {}
    set_registry(Registry.build(config=[table], env=env, entry_points=False, plugins=[("hpu_mxfp4", plugin1)]))
    seam = Seam()
    seam.patch_module(module)
    assert seam.patched is module.RoutedExperts
    seams.append(seam)
    return seam


@pytest.fixture
def harness() -> Iterator[Any]:
    from quantreg.testing.harness import VllmMoeHarness

    with VllmMoeHarness() as h:
        yield h


@pytest.fixture
def uninstall() -> Iterator[list[Any]]:
    seams: list[Any] = []
    yield seams
    from quantreg.registry import set_registry

    for seam in seams:
        seam.unpatch()
    set_registry(None)


TO_REFERENCE = "  - match: {quant_format: [gpt_oss_mxfp4, unquantized]}\n    method: mxfp4_reference\n"
TO_VLLM = "  - match: {quant_format: [gpt_oss_mxfp4, unquantized]}\n    method: vllm\n"


def subclasses() -> dict[str, type[Any]]:
    """Overrides of the seam, as vLLM's models write them."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    class WithSuper(RoutedExperts):  # type: ignore[misc]
        def _get_quant_method(self, prefix: str, quant_config: Any, moe_config: Any) -> Any:
            return super()._get_quant_method(prefix, quant_config, moe_config)

    class WithoutSuper(RoutedExperts):  # type: ignore[misc]
        """MuseSpark's shape: its own BF16 method, never asking the base."""

        def _get_quant_method(self, prefix: str, quant_config: Any, moe_config: Any) -> Any:
            return UnquantizedFusedMoEMethod(moe_config)

    class Discarding(RoutedExperts):  # type: ignore[misc]
        """DeepseekV4's shape: asks the base, then returns a method of its own."""

        def _get_quant_method(self, prefix: str, quant_config: Any, moe_config: Any) -> Any:
            super()._get_quant_method(prefix, quant_config, moe_config)
            return UnquantizedFusedMoEMethod(moe_config)

    class Refusing(RoutedExperts):  # type: ignore[misc]
        """DeepseekV4's check: raises unless the base built the kind of method it post-processes."""

        def _get_quant_method(self, prefix: str, quant_config: Any, moe_config: Any) -> Any:
            method = super()._get_quant_method(prefix, quant_config, moe_config)
            if not isinstance(method, UnquantizedFusedMoEMethod):
                raise ValueError("this fusion requires unquantized routed experts")
            return method

    class NamesButSkips(RoutedExperts):  # type: ignore[misc]
        """Names the base (so it looks like a super() override) but never calls it."""

        never = False

        def _get_quant_method(self, prefix: str, quant_config: Any, moe_config: Any) -> Any:
            if self.never:
                return super()._get_quant_method(prefix, quant_config, moe_config)
            return UnquantizedFusedMoEMethod(moe_config)

    class OtherSignature(RoutedExperts):  # type: ignore[misc]
        def _get_quant_method(self, prefix: str, quant_config: Any, moe_config: Any, fused: bool = False) -> Any:
            return UnquantizedFusedMoEMethod(moe_config)

    return {c.__name__: c for c in (WithSuper, WithoutSuper, Discarding, Refusing, NamesButSkips, OtherSignature)}


def real_layers(test: Any) -> Any:
    """Marks a test that builds real vLLM layers: the ``vllm`` and ``compat`` subsets, skipped without vLLM."""
    return pytest.mark.vllm(pytest.mark.compat(needs_vllm(test)))


def method_name(layer: Any) -> str:
    return type(layer.method).__name__


@real_layers
def test_overrides_with_and_without_super_are_routed(tmp_path: Path, harness: Any, records: Records,
                                                      uninstall: list[Any]) -> None:
    early = subclasses()  # defined before the seam is installed
    install(tmp_path, TO_REFERENCE, uninstall)
    late = subclasses()  # defined after
    for classes in (early, late):
        for name in ("WithSuper", "WithoutSuper"):
            layer = harness.build_routed(routed_experts_cls=classes[name])
            assert method_name(layer) == "Mxfp4ReferenceMoEMethod", name
            assert type(layer.experts) is classes[name]
            assert str(layer.experts.w13_weight.dtype) == "torch.uint8"  # the method's packed MXFP4 weights
    plain = harness.build_routed()
    assert method_name(plain) == "Mxfp4ReferenceMoEMethod"
    assert not [m for level, m in records.lines if level == "WARNING"], records.lines
    infos = [m for level, m in records.lines if level == "INFO" and "without super()" in m]
    assert len(infos) == 2 and all("WithoutSuper" in m and "routes its layers too" in m for m in infos)
    decided = [m for level, m in records.lines if level == "INFO" and f"{KEY} -> mxfp4_reference" in m]
    assert len(decided) == 1  # one decision line per key, whichever class asked


@real_layers
def test_decision_vllm_keeps_the_overrides_own_method(tmp_path: Path, harness: Any, records: Records,
                                                       uninstall: list[Any]) -> None:
    install(tmp_path, TO_VLLM, uninstall)
    layer = harness.build_routed(routed_experts_cls=subclasses()["WithoutSuper"], quant_config=None)
    assert (method_name(layer), records.warnings()) == ("UnquantizedFusedMoEMethod", []), records.lines


@real_layers
def test_discarded_decision_is_a_warning_naming_class_and_key(tmp_path: Path, harness: Any, records: Records,
                                                              uninstall: list[Any]) -> None:
    classes = subclasses()
    install(tmp_path, TO_REFERENCE, uninstall)
    for _ in range(2):
        layer = harness.build_routed(routed_experts_cls=classes["Discarding"])
        assert method_name(layer) == "UnquantizedFusedMoEMethod"  # the subclass wins; quantreg says so
    found = records.warnings("Discarding._get_quant_method discarded the registry's choice", KEY)
    assert len(found) == 1, records.lines  # once per class and key, not per layer
    assert "Mxfp4ReferenceMoEMethod" in found[0] and "UnquantizedFusedMoEMethod" in found[0]
    # a decision of 'vllm' that the subclass replaces is vLLM's own behaviour: nothing to say
    install(tmp_path, TO_VLLM, uninstall)
    harness.build_routed(routed_experts_cls=classes["Discarding"], quant_config=None)
    assert len(records.warnings("discarded")) == 1


@real_layers
def test_override_refusing_the_registrys_method(tmp_path: Path, harness: Any, records: Records,
                                                uninstall: list[Any]) -> None:
    from quantreg.problems import QuantregError

    refusing = subclasses()["Refusing"]
    install(tmp_path, TO_REFERENCE, uninstall)
    lenient = harness.build_routed(routed_experts_cls=refusing, quant_config=None)
    assert method_name(lenient) == "UnquantizedFusedMoEMethod"  # vLLM's own method underneath
    found = records.warnings("Refusing._get_quant_method refused the registry's Mxfp4ReferenceMoEMethod",
                             "(unquantized, gpt_oss, cpu)", "requires unquantized routed experts",
                             "using vLLM's own method")
    assert len(found) == 1, records.lines
    install(tmp_path, TO_REFERENCE, uninstall, strict=True)
    with pytest.raises(QuantregError, match=r"^quantreg \(strict\): .*refused the registry's Mxfp4ReferenceMoEMethod"):
        harness.build_routed(routed_experts_cls=refusing, quant_config=None)


@real_layers
@pytest.mark.parametrize(("name", "words"), [
    ("NamesButSkips", ("NamesButSkips._get_quant_method never reached quantreg's seam", KEY, "could not decide")),
    ("OtherSignature", ("OtherSignature._get_quant_method takes", "fused=False", "could not decide", KEY)),
])
def test_override_the_seam_cannot_decide_for_is_named_once(name: str, words: tuple[str, ...], tmp_path: Path,
                                                           harness: Any, records: Records,
                                                           uninstall: list[Any]) -> None:
    """One that names the base but never calls it, one with another signature: vLLM's own method, and
    one WARNING per class and key naming the class, however many layers it builds."""
    cls = subclasses()[name]
    install(tmp_path, TO_REFERENCE, uninstall)
    for _ in range(2):
        layer = harness.build_routed(routed_experts_cls=cls)
        assert method_name(layer) == "UnquantizedFusedMoEMethod"
    assert len(records.warnings(*words)) == 1, records.lines


@real_layers
def test_unpatch_restores_every_wrapped_function(tmp_path: Path, harness: Any, uninstall: list[Any]) -> None:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    classes = subclasses()
    before = {c: c.__dict__["_get_quant_method"] for c in classes.values()}
    base = (RoutedExperts.__dict__["_get_quant_method"], RoutedExperts.__dict__["__init__"])
    seam = install(tmp_path, TO_REFERENCE, uninstall)
    for cls in classes.values():
        harness.build_routed(routed_experts_cls=cls, quant_config=None)
    assert all(c.__dict__["_get_quant_method"] is not f for c, f in before.items())
    seam.unpatch()
    assert {c: c.__dict__["_get_quant_method"] for c in classes.values()} == before
    assert (RoutedExperts.__dict__["_get_quant_method"], RoutedExperts.__dict__["__init__"]) == base


def test_changed_seam_signature_keeps_quantreg_inactive(caplog: pytest.LogCaptureFixture) -> None:
    """A vLLM whose seam takes other arguments: one WARNING, the class left exactly as it was."""
    from quantreg.vllm.seam import Seam

    def _get_quant_method(self: Any, prefix: str, quant_config: Any, moe_config: Any, layer_id: int) -> Any:
        return ("vLLM", prefix, layer_id)

    def __init__(self: Any) -> None:
        self.quant_method = self._get_quant_method("p", None, None, 7)

    routed_experts = type("RoutedExperts", (), {"_get_quant_method": _get_quant_method, "__init__": __init__})
    module = types.ModuleType(MODULE)
    module.RoutedExperts = routed_experts  # type: ignore[attr-defined]
    seam = Seam()
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg"):
        seam.patch_module(module)
        seam.patch_module(module)  # a second import hook firing changes nothing either
    assert seam.patched is None
    assert routed_experts.__dict__["_get_quant_method"] is _get_quant_method
    assert routed_experts.__dict__["__init__"] is __init__
    assert routed_experts().quant_method == ("vLLM", "p", 7)  # layer builds keep working
    found = [r.getMessage() for r in caplog.records if "quantreg is inactive" in r.getMessage()]
    assert len(found) == 1 and "layer_id)" in found[0] and "(self, prefix, quant_config, moe_config)" in found[0]


def test_signature_problem_reads_names_and_kinds() -> None:
    from quantreg.vllm.coverage import calls_base, signature_problem

    def good(self: Any, prefix: str, quant_config: Any, moe_config: Any) -> None: ...
    def renamed(self: Any, prefix: str, config: Any, moe_config: Any) -> None: ...
    def keyword_only(self: Any, prefix: str, quant_config: Any, *, moe_config: Any) -> None: ...
    def with_super(self: Any, prefix: str, quant_config: Any, moe_config: Any) -> Any:
        return super()._get_quant_method(prefix, quant_config, moe_config)  # type: ignore[misc]

    assert signature_problem(good) is None
    assert signature_problem(renamed) == "(self, prefix, config, moe_config)"
    assert signature_problem(keyword_only) is not None
    assert calls_base(with_super) and not calls_base(good)
