"""The verifying side is contained (issue 21 class 3): nothing the ``against`` method does changes or
stops the chosen method's output.

A grammar of misbehaviours (what the against method does) x when it does it (at load, in the load
check's synthetic pass; or live, on a later verified forward call; or in one of its lifecycle hooks)
x mode, driven through the real wrapper (:class:`quantreg.vllm.verify.VerifyingMethod`) on real vLLM
MoE layers from the kit's harness, with real torch tensors. Lenient: exactly one WARNING, the chosen
output equal to the chosen method alone, the against method never called again. Strict: refused at
load with one ``quantreg (strict): verify:`` line; live, never a raise (one ERROR line).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from e2e_support import VERIFY_PREFIX, verify_inputs

torch = pytest.importorskip("torch")
pytest.importorskip("quantreg_hpu_mxfp4", reason="plugin #1 (plugins/hpu_mxfp4) is not installed")

from quantreg_hpu_mxfp4.method import Mxfp4ReferenceMoEMethod  # noqa: E402

from quantreg.keys import Key  # noqa: E402
from quantreg.problems import QuantregError  # noqa: E402
from quantreg.table.verify import VerifySpec  # noqa: E402
from quantreg.testing.harness import VllmMoeHarness  # noqa: E402
from quantreg.vllm.verify import VerifyingMethod, _Report  # noqa: E402

KEY = Key("gpt_oss_mxfp4", "gpt_oss", "cpu")
PREFIX = VERIFY_PREFIX
EXPERTS, X, LOGITS = verify_inputs()
CALLS = 5


def _raise(exc: BaseException) -> Callable[[torch.Tensor], Any]:
    def go(out: torch.Tensor) -> Any:
        raise exc
    return go


#: What the against method's forward returns instead of its output (or raises).
BEHAVIOURS: dict[str, Callable[[torch.Tensor], Any]] = {
    "raises ValueError": _raise(ValueError("broken kernel")),
    "raises SystemExit": _raise(SystemExit(3)),
    "raises RuntimeError with a newline": _raise(RuntimeError("line one\nFORGED line")),
    "returns None": lambda out: None,
    "returns a list": lambda out: out.tolist(),
    "returns one row too few": lambda out: out[:-1],
    "returns one column too few": lambda out: out[..., :-1],
    "returns a scalar": lambda out: out.sum(),
    "returns an extra leading dim twice over": lambda out: torch.stack([out, out]),
    "returns NaN": lambda out: torch.full_like(out, float("nan")),
    "returns +inf in one place": lambda out: out.index_fill(0, torch.tensor([0]), float("inf")),
    "returns a bool tensor": lambda out: out > 0,
    "returns an empty tensor": lambda out: out[:0],
}


class Misbehaving(Mxfp4ReferenceMoEMethod):  # type: ignore[misc]
    """``mxfp4_reference`` whose ``behave_at``-th forward call (1 = the load check) misbehaves."""

    def __init__(self, moe_config: Any, behaviour: Callable[[torch.Tensor], Any], behave_at: int,
                 hook: str = "apply", **options: Any) -> None:
        super().__init__(moe_config, **options)
        self.behaviour, self.behave_at, self.hook, self.forwards = behaviour, behave_at, hook, 0

    def create_weights(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
        if self.hook == "create_weights":
            self.behaviour(torch.zeros(1))
        return super().create_weights(layer, *args, **kwargs)

    def process_weights_after_loading(self, layer: Any) -> None:
        if self.hook == "process_weights_after_loading":
            self.behaviour(torch.zeros(1))
        super().process_weights_after_loading(layer)

    def _misbehave(self, out: Any) -> Any:
        self.forwards += 1
        return self.behaviour(out) if self.forwards == self.behave_at else out

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        return self._misbehave(super().apply(*args, **kwargs))

    def apply_monolithic(self, *args: Any, **kwargs: Any) -> Any:
        return self._misbehave(super().apply_monolithic(*args, **kwargs))


@pytest.fixture(scope="module")
def harness() -> Any:
    with VllmMoeHarness() as h:
        yield h


@pytest.fixture(scope="module")
def plain_output(harness: Any) -> torch.Tensor:
    plain = harness.ready(lambda cfg: Mxfp4ReferenceMoEMethod(cfg), EXPERTS, top_k=2)
    out: torch.Tensor = plain.forward(X, LOGITS)
    return out


def build(harness: Any, behaviour: str, behave_at: int, strict: bool, hook: str = "apply") -> tuple[Any, list[Any]]:
    made: list[Any] = []

    def factory(cfg: Any) -> Any:
        against = Misbehaving(cfg, BEHAVIOURS[behaviour], behave_at, hook)
        made.append(against)
        spec = VerifySpec("misbehaving", first=CALLS, tolerance=0.02)
        return VerifyingMethod(Mxfp4ReferenceMoEMethod(cfg), against, spec,
                               _Report(PREFIX, KEY, "mxfp4_reference", "misbehaving", spec, strict))

    return harness.ready(factory, EXPERTS, top_k=2), made


def quantreg_records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("vllm.quantreg") and r.levelno == level]


@pytest.mark.parametrize("behave_at", [1, 3], ids=["at-load", "live"])
@pytest.mark.parametrize("behaviour", list(BEHAVIOURS))
def test_lenient_one_warning_and_the_chosen_output_untouched(
        harness: Any, plain_output: torch.Tensor, caplog: pytest.LogCaptureFixture, behaviour: str,
        behave_at: int) -> None:
    with caplog.at_level(logging.INFO, logger="vllm.quantreg"):
        layer, (against,) = build(harness, behaviour, behave_at, strict=False)
        outs = [layer.forward(X, LOGITS) for _ in range(CALLS)]
    assert all(torch.equal(out, plain_output) for out in outs)
    warnings = quantreg_records(caplog, logging.WARNING)
    assert len(warnings) == 1 and "cannot verify" in warnings[0] and "runs unverified" in warnings[0], warnings
    assert "\nFORGED" not in warnings[0]  # a value from the method is escaped on its way to the log
    assert against.forwards == behave_at  # verification is off for the layer from then on
    assert not quantreg_records(caplog, logging.ERROR)


@pytest.mark.parametrize("hook", ["create_weights", "process_weights_after_loading"])
@pytest.mark.parametrize("behaviour", ["raises ValueError", "raises SystemExit"])
def test_lenient_lifecycle_hooks_of_the_against_method(
        harness: Any, plain_output: torch.Tensor, caplog: pytest.LogCaptureFixture, behaviour: str,
        hook: str) -> None:
    with caplog.at_level(logging.INFO, logger="vllm.quantreg"):
        layer, (against,) = build(harness, behaviour, 0, strict=False, hook=hook)
        assert torch.equal(layer.forward(X, LOGITS), plain_output)
    warnings = quantreg_records(caplog, logging.WARNING)
    assert len(warnings) == 1 and "cannot verify" in warnings[0], warnings
    assert against.forwards == 0


@pytest.mark.parametrize("behaviour", ["raises SystemExit", "returns None", "returns one row too few", "returns NaN"])
def test_strict_fails_closed_at_load(harness: Any, behaviour: str) -> None:
    with pytest.raises(QuantregError, match=r"^quantreg \(strict\): verify: model\.layers\.0\.mlp\.experts "
                                            r"\(gpt_oss_mxfp4, gpt_oss, cpu\): mxfp4_reference vs misbehaving: "
                                            r"cannot verify \(.*\); mxfp4_reference runs unverified$"):
        build(harness, behaviour, 1, strict=True)


@pytest.mark.parametrize("behaviour", ["raises SystemExit", "returns None", "returns one column too few"])
def test_strict_never_raises_mid_request(harness: Any, plain_output: torch.Tensor, caplog: pytest.LogCaptureFixture,
                                         behaviour: str) -> None:
    with caplog.at_level(logging.INFO, logger="vllm.quantreg"):
        layer, _ = build(harness, behaviour, 3, strict=True)
        outs = [layer.forward(X, LOGITS) for _ in range(CALLS)]
    assert all(torch.equal(out, plain_output) for out in outs)
    errors = quantreg_records(caplog, logging.ERROR)
    assert len(errors) == 1 and "cannot verify" in errors[0], errors
