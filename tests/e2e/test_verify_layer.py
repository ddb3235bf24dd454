"""``verify:`` on real vLLM MoE layers built by the kit's harness (no engine): fast and exact.

Each layer is made by vLLM's own ``FusedMoEFactory``, loaded the way vLLM's GPT-OSS loader loads
it and run through ``MoERunner.forward`` (see :mod:`quantreg.testing.harness`); the method is the
one :func:`quantreg.vllm.verify.maybe_verify` returns, as the seam would hand it to vLLM.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from e2e_support import VERIFY_PREFIX, verify_inputs

torch = pytest.importorskip("torch")
pytest.importorskip("quantreg_hpu_mxfp4", reason="plugin #1 (plugins/hpu_mxfp4) is not installed")

from quantreg_hpu_mxfp4.method import Mxfp4ReferenceMoEMethod  # noqa: E402

from quantreg.decision import Decision  # noqa: E402
from quantreg.keys import Key, Match  # noqa: E402
from quantreg.mode import Mode  # noqa: E402
from quantreg.problems import QuantregError  # noqa: E402
from quantreg.registry import set_registry  # noqa: E402
from quantreg.table.file import Rule, Tier  # noqa: E402
from quantreg.table.verify import VerifySpec  # noqa: E402
from quantreg.testing.harness import VllmMoeHarness  # noqa: E402
from quantreg.vllm.verify import VerifyingMethod, maybe_verify  # noqa: E402

KEY = Key("gpt_oss_mxfp4", "gpt_oss", "cpu")
PREFIX = VERIFY_PREFIX
EXPERTS, X, LOGITS = verify_inputs()


class NibblesSwapped(Mxfp4ReferenceMoEMethod):  # type: ignore[misc]
    """Swaps the two codes of every w13 byte in place before binding (the classic unpacking bug)."""

    def process_weights_after_loading(self, layer: Any) -> None:
        packed = layer.w13_weight.data
        packed.copy_(((packed & 0x0F) << 4) | (packed >> 4))
        super().process_weights_after_loading(layer)


@pytest.fixture(scope="module")
def harness() -> Any:
    with VllmMoeHarness() as h:
        yield h


@pytest.fixture
def audit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[dict[str, Any]]]:
    """Point the audit trail (``QUANTREG_DECISIONS``) at a file; the fixture reads its records."""
    path = tmp_path / "decisions.jsonl"
    monkeypatch.setenv("QUANTREG_DECISIONS", str(path))
    monkeypatch.delenv("QUANTREG_CONFIG", raising=False)
    set_registry(None)  # the installed plugins only (mxfp4_reference)

    def records() -> list[dict[str, Any]]:
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    return records


def decision(spec: VerifySpec, method: str = "mxfp4_reference", line: int = 3) -> Decision:
    """What the registry resolves for a rule at t.yaml:LINE (``layers: N`` counts per rule)."""
    rule = Rule(match=Match(), methods=(method,), path="t.yaml", line=line, tier=Tier.USER, verify=spec)
    return Decision(KEY, method, rule, {}, (), ())


def verified(cls: type[Any], spec: VerifySpec, *, strict: bool = False, prefix: str = PREFIX,
             **options: Any) -> Callable[[Any], Any]:
    """The seam's construction of ``cls`` followed by its one ``maybe_verify`` call."""
    def build(moe_config: Any) -> Any:
        return maybe_verify(cls(moe_config, **options), decision(spec), prefix, None, moe_config, Mode(strict))

    return build


@pytest.mark.parametrize("routing", ["auto", "vllm"])  # monolithic (routes inside) / modular (vLLM's router)
def test_verified_layer_is_the_chosen_method_with_unchanged_output(
        harness: Any, audit: Callable[[], list[dict[str, Any]]], routing: str) -> None:
    spec = VerifySpec("float64", first=3, every=2, tolerance=0.02)
    layer = harness.ready(verified(Mxfp4ReferenceMoEMethod, spec, routing=routing), EXPERTS, top_k=2)
    plain = harness.ready(lambda cfg: Mxfp4ReferenceMoEMethod(cfg, routing=routing), EXPERTS, top_k=2)
    method = layer.experts.quant_method
    assert type(method) is VerifyingMethod
    assert isinstance(method, Mxfp4ReferenceMoEMethod) and method.__class__ is Mxfp4ReferenceMoEMethod
    assert method.is_monolithic == plain.method.is_monolithic == (routing == "auto")
    assert method.moe_quant_config is method.quantreg_verifying[0].moe_quant_config  # vLLM's writes reach it
    expected = plain.forward(X, LOGITS)
    outs = [layer.forward(X, LOGITS) for _ in range(8)]
    assert all(torch.equal(out, expected) for out in outs)  # the chosen method's output, unchanged
    records = audit()
    assert [(r["phase"], r["call"]) for r in records] == [("load", 0)] + [("live", c) for c in (1, 2, 3, 5, 7)]
    # the load check (synthetic tokens, before any forward), then the first 3 calls, then 1 in 2
    assert all(r["ok"] and 0 < r["error"] < 0.02 and r["prefix"] == PREFIX for r in records), records
    assert {(r["method"], r["against"]) for r in records} == {("mxfp4_reference", "float64")}


def test_the_shadow_copy_is_taken_before_the_chosen_method_changes_the_weights(
        harness: Any, audit: Callable[[], list[dict[str, Any]]]) -> None:
    spec = VerifySpec("mxfp4_reference", first=2, tolerance=0.02)
    layer = harness.ready(verified(NibblesSwapped, spec), EXPERTS, top_k=2)
    broken = harness.ready(lambda cfg: NibblesSwapped(cfg), EXPERTS, top_k=2)
    assert torch.equal(layer.forward(X, LOGITS), broken.forward(X, LOGITS))
    layer.forward(X, LOGITS)
    errors = [r["error"] for r in audit()]
    assert len(errors) == 3 and min(errors) > 0.05  # load + 2 calls, against the weights as loaded, not as swapped


def test_strict_mode_refuses_at_load_before_any_forward(harness: Any,
                                                       audit: Callable[[], list[dict[str, Any]]]) -> None:
    with pytest.raises(QuantregError, match=r"^quantreg \(strict\): verify: model\.layers\.0\.mlp\.experts "
                                            r"\(gpt_oss_mxfp4, gpt_oss, cpu\): mxfp4_reference vs mxfp4_reference: "
                                            r"error \S+ on 8 synthetic tokens at load exceeds tolerance 0\.02; "
                                            r"refusing to start$"):
        harness.ready(verified(NibblesSwapped, VerifySpec("mxfp4_reference"), strict=True), EXPERTS, top_k=2)
    assert [(r["phase"], r["ok"]) for r in audit()] == [("load", False)]


def test_lenient_load_exceedance_warns_before_the_first_forward(
        harness: Any, audit: Callable[[], list[dict[str, Any]]], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="vllm.quantreg"):
        harness.ready(verified(NibblesSwapped, VerifySpec("mxfp4_reference", first=1)), EXPERTS, top_k=2)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and ": load: " in warned[0] and "EXCEEDS tolerance 0.02" in warned[0], warned
    assert [(r["phase"], r["ok"]) for r in audit()] == [("load", False)]  # no forward yet


def test_uncovered_layers_get_the_method_itself(harness: Any, audit: Callable[[], list[dict[str, Any]]]) -> None:
    moe_config = harness.moe_config()
    method = Mxfp4ReferenceMoEMethod(moe_config)
    first_two = VerifySpec("float64", first=2, decoders=2)
    built = [maybe_verify(method, decision(first_two, line=99), f"model.layers.{i}.mlp.experts", None, moe_config,
                          Mode(False)) for i in (4, 5, 6, 4)]  # layers 0-3 dense; 4 again: a second model
    assert [b is method for b in built] == [False, False, True, False]
    for spec, prefix in ((VerifySpec("float64", decoders=(0, 3)), "model.layers.1.mlp.experts"),
                         (VerifySpec("float64"), "model.mlp.experts")):
        assert maybe_verify(method, decision(spec), prefix, None, moe_config, Mode(False)) is method


@pytest.mark.parametrize("strict", [False, True])
def test_an_against_method_that_cannot_run_here(harness: Any, audit: Callable[[], list[dict[str, Any]]],
                                                strict: bool) -> None:
    moe_config = harness.moe_config()
    method = Mxfp4ReferenceMoEMethod(moe_config)
    spec = VerifySpec("hpu_mxfp4")
    if strict:
        with pytest.raises(QuantregError, match=r"cannot verify .*'hpu_mxfp4' cannot run here: runs on hpu, not cpu"):
            maybe_verify(method, decision(spec), PREFIX, None, moe_config, Mode(True))
    else:
        assert maybe_verify(method, decision(spec), PREFIX, None, moe_config, Mode(False)) is method
