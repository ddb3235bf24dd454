"""The ``tokens:`` split on real vLLM MoE layers built by the kit's harness (no engine): weights and dispatch.

Each layer is made by vLLM's own ``FusedMoEFactory``, loaded the way vLLM's GPT-OSS loader loads it
and run through ``MoERunner.forward``; its method is a :class:`quantreg.vllm.token_split.TokenSplitMethod`
as the seam builds it. What the two sides do to the loaded weights decides whether they can share them:

* ``cpu_mxfp4`` (plugin #2) repacks into tensors of its own and drops the layer's parameters;
* ``mxfp4_reference`` (plugin #1) binds views of the loaded parameters (nothing copied);
* vLLM 0.32's own CPU MXFP4 method (``CPUExpertsMxfp4``, AMX hosts) repacks into new tensors and
  registers them in place of the loaded ones (``replace_parameter``): the loaded tensors are unchanged;
* ``ExpertsReversed`` below is an in-place repack (what ``replace_parameter(..., prefer_copy=True)``
  would do): it reverses the expert order of every parameter in place and mirrors the router logits.

Every case checks, at a decode size and a prefill size, that the split's output is the output of the
side's method alone on a layer of its own (exactly, or within 1e-6 where a side reorders a sum), and
how the weights were handled (shared, or copied for the side that needs the loaded form).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("quantreg_hpu_mxfp4", reason="plugin #1 (plugins/hpu_mxfp4) is not installed")
pytest.importorskip("quantreg_cpu_mxfp4", reason="plugin #2 (plugins/cpu_mxfp4) is not installed")

from quantreg_cpu_mxfp4.method import CpuMxfp4MoEMethod  # noqa: E402
from quantreg_hpu_mxfp4.method import Mxfp4ReferenceMoEMethod  # noqa: E402

from quantreg.decision import Decision  # noqa: E402
from quantreg.error_measure import relative_error  # noqa: E402
from quantreg.keys import Key, TokenRange  # noqa: E402
from quantreg.models.gpt_oss import PARAMETERS  # noqa: E402
from quantreg.models.gpt_oss_moe import (  # noqa: E402
    random_gpt_oss_mxfp4_experts,
    random_hidden_states,
    random_router_logits,
)
from quantreg.testing.harness import VllmMoeHarness  # noqa: E402
from quantreg.vllm.token_split import Side, TokenSplitMethod, _Report  # noqa: E402

KEY = Key("gpt_oss_mxfp4", "gpt_oss", "cpu")
BOUND = 4
E, H, INTER = 8, 128, 128  # intermediate a multiple of 64: vLLM's CPU padding (32) and the plugins' (64) agree
EXPERTS = random_gpt_oss_mxfp4_experts(E, H, INTER, bias=True, seed=11)
SIZES = (1, 3, 5, 24)  # two decode sizes (<= BOUND), two prefill sizes


class ExpertsReversed(Mxfp4ReferenceMoEMethod):  # type: ignore[misc]
    """An in-place repack: every parameter's experts reversed in place, the router logits mirrored to match."""

    def process_weights_after_loading(self, layer: Any) -> None:
        for name in PARAMETERS:
            param = layer._parameters.get(name)
            if param is not None:
                param.data.copy_(param.data.flip(0))
        super().process_weights_after_loading(layer)

    def apply_monolithic(self, layer: Any, x: Any, router_logits: Any, input_ids: Any = None, **kw: Any) -> Any:
        return super().apply_monolithic(layer, x, router_logits.flip(-1), input_ids, **kw)


@pytest.fixture(scope="module")
def harness() -> Any:
    with VllmMoeHarness() as h:
        yield h


def split_factory(small: Callable[[Any], Any], large: Callable[[Any], Any], names: tuple[str, str],
                  made: list[TokenSplitMethod]) -> Callable[[Any], Any]:
    def build(moe_config: Any) -> Any:
        sides = [Side(TokenRange(1, BOUND), Decision(KEY, names[0], None, {}, (), ()), small(moe_config)),
                 Side(TokenRange(BOUND + 1, None), Decision(KEY, names[1], None, {}, (), ()), large(moe_config))]
        method = TokenSplitMethod(sides, _Report("model.layers.0.mlp.experts", KEY, False))
        made.append(method)
        return method

    return build


def inputs(tokens: int) -> tuple[Any, Any]:
    return random_hidden_states(tokens, H, seed=100 + tokens), random_router_logits(tokens, E, seed=200 + tokens)


def check(harness: Any, small: Callable[[Any], Any], large: Callable[[Any], Any], names: tuple[str, str],
          caplog: pytest.LogCaptureFixture) -> tuple[TokenSplitMethod, str]:
    made: list[TokenSplitMethod] = []
    with caplog.at_level(logging.INFO, logger="vllm.quantreg.split"):
        layer = harness.ready(split_factory(small, large, names, made), EXPERTS, top_k=2)
    alone = {names[0]: harness.ready(small, EXPERTS, top_k=2), names[1]: harness.ready(large, EXPERTS, top_k=2)}
    split = made[0]
    assert layer.experts.quant_method is split and split.quantreg_split == ((f"<={BOUND}", names[0]),
                                                                            (f">{BOUND}", names[1]))
    for tokens in SIZES:
        x, logits = inputs(tokens)
        got = layer.forward(x, logits)
        want = alone[names[0] if tokens <= BOUND else names[1]].forward(x, logits)
        assert relative_error(got, want) <= 1e-6, (tokens, relative_error(got, want))
        reference = EXPERTS.reference(x.double(), *topk_f64(logits))
        assert relative_error(got.double(), reference) <= 0.02, tokens  # and right, against float64
    lines = [r.getMessage() for r in caplog.records if ": split " in r.getMessage()]
    assert len(lines) == 1, lines
    return split, lines[0]


def topk_f64(logits: Any) -> tuple[Any, Any]:
    probs = torch.softmax(logits.double(), dim=-1)
    weights, ids = torch.topk(probs, 2, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


def test_methods_that_leave_the_loaded_weights_as_loaded_share_them(harness: Any,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    _, line = check(harness, CpuMxfp4MoEMethod, Mxfp4ReferenceMoEMethod, ("cpu_mxfp4", "mxfp4_reference"), caplog)
    assert "shares the loaded weights: 0.00 MiB copied" in line  # cpu_mxfp4 dropped them: kept for the other
    assert "0.00 MiB kept" not in line


def test_an_in_place_repack_by_the_first_side_gives_the_other_its_own_copy(
        harness: Any, caplog: pytest.LogCaptureFixture) -> None:
    _, line = check(harness, ExpertsReversed, CpuMxfp4MoEMethod, ("reversed", "cpu_mxfp4"), caplog)
    assert "own copy of the loaded weights" in line and "0.00 MiB copied" not in line


@pytest.mark.parametrize("first", [CpuMxfp4MoEMethod, Mxfp4ReferenceMoEMethod], ids=["repacks", "binds_views"])
def test_an_in_place_repack_by_the_other_side_is_undone_and_given_a_copy(
        harness: Any, caplog: pytest.LogCaptureFixture, first: type[Any]) -> None:
    """The first side may hold views of the loaded weights (mxfp4_reference): they are restored exactly."""
    _, line = check(harness, first, ExpertsReversed, ("first", "reversed"), caplog)
    assert "own copy of the loaded weights" in line


def test_vllms_own_kernel_beside_a_plugin_method(harness: Any, caplog: pytest.LogCaptureFixture) -> None:
    from quantreg.testing.host_kind import real_amx

    if not real_amx():
        pytest.skip("vLLM's own CPU MXFP4 kernel needs AMX (this host has none)")
    from quantreg.vllm.moe_method import upstream_mxfp4_method

    vllm_own = upstream_mxfp4_method()
    split, line = check(harness, lambda cfg: CpuMxfp4MoEMethod(cfg, routing="vllm"), vllm_own,
                        ("cpu_mxfp4", "vllm"), caplog)
    # vLLM's own method is modular: the split lets vLLM's router choose and hands each side its choice
    # (so the plugin side is compared with itself under vLLM's router)
    assert not split.is_monolithic
    assert "shares the loaded weights: 0.00 MiB copied" in line  # vLLM 0.32 registers new tensors


def test_a_side_whose_layout_differs_is_dropped_and_the_other_serves(harness: Any,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    class Wider(Mxfp4ReferenceMoEMethod):  # type: ignore[misc]
        """Creates w2_weight one row wider than the first side: cannot read the same loaded weights."""

        def create_weights(self, layer: Any, num_experts: int, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
            return super().create_weights(layer, num_experts, hidden_size + 32, *args, **kwargs)

    made: list[TokenSplitMethod] = []
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg.split"):
        layer = harness.ready(split_factory(CpuMxfp4MoEMethod, Wider, ("cpu_mxfp4", "wider"), made), EXPERTS,
                              top_k=2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'wider' for tokens>4 cannot share this layer's weights" in w and "'cpu_mxfp4' serves" in w
               for w in warnings), warnings
    assert made[0].quantreg_split == ((">=1", "cpu_mxfp4"),)
    alone = harness.ready(CpuMxfp4MoEMethod, EXPERTS, top_k=2)
    for tokens in SIZES:
        x, logits = inputs(tokens)
        assert torch.equal(layer.forward(x, logits), alone.forward(x, logits))


def test_a_side_that_raises_on_a_forward_is_turned_off(harness: Any, caplog: pytest.LogCaptureFixture) -> None:
    class Breaks(Mxfp4ReferenceMoEMethod):  # type: ignore[misc]
        def apply_monolithic(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("kernel fault")

    made: list[TokenSplitMethod] = []
    layer = harness.ready(split_factory(CpuMxfp4MoEMethod, Breaks, ("cpu_mxfp4", "breaks"), made), EXPERTS, top_k=2)
    alone = harness.ready(CpuMxfp4MoEMethod, EXPERTS, top_k=2)
    x, logits = inputs(24)
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg.split"):
        assert torch.equal(layer.forward(x, logits), alone.forward(x, logits))
    assert any("'breaks' for tokens>4 raised on a forward (RuntimeError: kernel fault)" in r.getMessage()
               for r in caplog.records)
    assert made[0].quantreg_split == ((">=1", "cpu_mxfp4"),)


def test_verify_covers_both_sides(harness: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each side's rule verifies that side (``verify:`` per rule), inside the split, on its own forwards."""
    import json

    from quantreg.keys import Match
    from quantreg.mode import Mode
    from quantreg.registry import set_registry
    from quantreg.table.file import Rule, Tier
    from quantreg.table.verify import VerifySpec
    from quantreg.vllm.verify import VerifyingMethod, maybe_verify

    trail = tmp_path / "decisions.jsonl"
    monkeypatch.setenv("QUANTREG_DECISIONS", str(trail))
    monkeypatch.delenv("QUANTREG_CONFIG", raising=False)
    set_registry(None)
    spec = VerifySpec("float64", first=2, every=1000, tolerance=0.02)
    prefix = "model.layers.0.mlp.experts"

    def side(cls: type[Any], name: str, line: int, tokens: TokenRange, moe_config: Any) -> Side:
        rule = Rule(match=Match(tokens=tokens), methods=(name,), path="split.yaml", line=line, tier=Tier.USER,
                    verify=spec)
        decision = Decision(KEY, name, rule, {}, (), ())
        return Side(tokens, decision, maybe_verify(cls(moe_config), decision, prefix, None, moe_config, Mode(False)))

    made: list[TokenSplitMethod] = []

    def build(moe_config: Any) -> Any:
        method = TokenSplitMethod([side(CpuMxfp4MoEMethod, "cpu_mxfp4", 3, TokenRange(1, BOUND), moe_config),
                                   side(Mxfp4ReferenceMoEMethod, "mxfp4_reference", 5, TokenRange(BOUND + 1, None),
                                        moe_config)], _Report(prefix, KEY, False))
        made.append(method)
        return method

    layer = harness.ready(build, EXPERTS, top_k=2)
    assert all(type(s.method) is VerifyingMethod for s in made[0]._quantreg_sides)
    for tokens in (1, 1, 24, 24, 1):
        x, logits = inputs(tokens)
        layer.forward(x, logits)
    records = [json.loads(line) for line in trail.read_text().splitlines()]
    verified = [(r["method"], r["phase"], r["call"]) for r in records if r.get("event") == "verify"]
    assert verified[:2] == [("cpu_mxfp4", "load", 0), ("mxfp4_reference", "load", 0)], verified  # at load
    assert sorted(verified[2:]) == sorted([("cpu_mxfp4", "live", 1), ("cpu_mxfp4", "live", 2),
                                           ("mxfp4_reference", "live", 1), ("mxfp4_reference", "live", 2)]), verified
    assert all(r["ok"] for r in records if r.get("event") == "verify")
    served = sorted((r["method"], r["forward_tokens"]) for r in records if r.get("event") == "split_forward")
    assert served == [("cpu_mxfp4", 1), ("mxfp4_reference", 24)]


def test_strict_refuses_a_side_that_cannot_share_the_layer(harness: Any) -> None:
    from quantreg.problems import QuantregError

    class Wider(Mxfp4ReferenceMoEMethod):  # type: ignore[misc]
        def create_weights(self, layer: Any, num_experts: int, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
            return super().create_weights(layer, num_experts, hidden_size + 32, *args, **kwargs)

    def build(moe_config: Any) -> Any:
        first = CpuMxfp4MoEMethod(moe_config)
        sides = [Side(TokenRange(1, BOUND), Decision(KEY, "cpu_mxfp4", None, {}, (), ()), first),
                 Side(TokenRange(BOUND + 1, None), Decision(KEY, "wider", None, {}, (), ()), Wider(moe_config))]
        return TokenSplitMethod(sides, _Report("model.layers.0.mlp.experts", KEY, True))

    with pytest.raises(QuantregError, match=r"quantreg \(strict\): model.layers.0.mlp.experts .*'wider' for "
                                            r"tokens>4 cannot share this layer's weights"):
        harness.ready(build, EXPERTS, top_k=2)


@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
def test_a_side_whose_weights_would_leave_too_little_memory_is_not_kept(
        harness: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, strict: bool) -> None:
    """cpu_mxfp4 repacks and drops the loaded weights; mxfp4_reference reads them, so the split keeps them
    alive for it, once per layer. With less memory available than QUANTREG_SPLIT_MEMORY_RESERVE after
    that (a reserve above this host's memory here), the side is dropped before it can take the process
    down with the OOM killer: lenient, one WARNING naming the bytes and the setting, the first side
    serving every token count; strict, the start refused."""
    from quantreg.host import memory_available
    from quantreg.problems import QuantregError

    available = memory_available()
    assert available is not None and available > 0  # Linux: /proc/meminfo
    monkeypatch.setenv("QUANTREG_SPLIT_MEMORY_RESERVE", str(2 * available / 2**30))
    made: list[TokenSplitMethod] = []

    def build(moe_config: Any) -> Any:
        sides = [Side(TokenRange(1, BOUND), Decision(KEY, "cpu_mxfp4", None, {}, (), ()),
                      CpuMxfp4MoEMethod(moe_config)),
                 Side(TokenRange(BOUND + 1, None), Decision(KEY, "mxfp4_reference", None, {}, (), ()),
                      Mxfp4ReferenceMoEMethod(moe_config))]
        made.append(TokenSplitMethod(sides, _Report("model.layers.0.mlp.experts", KEY, strict)))
        return made[-1]

    expected = (r"model.layers.0.mlp.experts .*'mxfp4_reference' for tokens>4 is not kept: its \d+ MiB of weights "
                r"for this layer would leave [\d.]+ GiB of memory available, under QUANTREG_SPLIT_MEMORY_RESERVE=")
    if strict:
        with pytest.raises(QuantregError, match=r"quantreg \(strict\): " + expected):
            harness.ready(build, EXPERTS, top_k=2)
        return
    with caplog.at_level(logging.INFO, logger="vllm.quantreg.split"):
        layer = harness.ready(build, EXPERTS, top_k=2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(re.search(expected, w) and "'cpu_mxfp4' serves those forwards" in w for w in warnings), warnings
    assert made[0].quantreg_split == ((">=1", "cpu_mxfp4"),)
    loads = [r.getMessage() for r in caplog.records if ": split " in r.getMessage()]
    assert loads and "0.00 MiB kept alive" in loads[0]  # nothing held for the dropped side
    alone = harness.ready(CpuMxfp4MoEMethod, EXPERTS, top_k=2)
    for tokens in SIZES:
        x, logits = inputs(tokens)
        assert torch.equal(layer.forward(x, logits), alone.forward(x, logits))
