"""``quantreg.vllm.routing``: the expert-selection helpers MoE methods share (issue 24, duplicates D3).

Both plugins once carried their own copy; these tests hold the one copy to what the copies did:
the two in-method orders against the float64 GPT-OSS router, the features a plain softmax + top-k
does not compute read from real vLLM layers (``quantreg.testing.harness``), the refusal text, and
global -> local ids through the ``expert_map`` vLLM builds for an expert-parallel rank.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the routing helpers compute on torch tensors")

from quantreg.models.gpt_oss_moe import random_router_logits, route_topk_softmax  # noqa: E402
from quantreg.vllm import routing  # noqa: E402

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (real layers are built)")
EXPERTS = 8  # the harness's default shape


@pytest.fixture(scope="module")
def harness() -> Iterator[Any]:
    from quantreg.testing.harness import VllmMoeHarness

    with VllmMoeHarness() as h:
        yield h


def _probe_class() -> type[Any]:
    from quantreg.vllm.moe_method import init_without_backend, upstream_mxfp4_method

    class Probe(upstream_mxfp4_method()):  # type: ignore[misc]
        def __init__(self, moe: Any) -> None:
            init_without_backend(self, moe)

    return Probe


def test_topk_softmax_is_gpt_oss_routing() -> None:
    logits = random_router_logits(16, EXPERTS, seed=3)
    weights, ids = routing.select_in_method("topk_softmax", 2, logits)
    want_w, want_ids = route_topk_softmax(logits, 2)
    assert weights.dtype == torch.float32 and torch.equal(ids, want_ids)
    assert torch.allclose(weights.double(), want_w, atol=1e-6)


def test_softmax_topk_picks_the_same_experts_and_renormalises() -> None:
    logits = random_router_logits(16, EXPERTS, seed=4)
    weights, ids = routing.select_in_method("softmax_topk", 3, logits)
    want_w, want_ids = route_topk_softmax(logits, 3)  # softmax is monotonic: same experts, same weights
    assert torch.equal(ids, want_ids)
    assert torch.allclose(weights.sum(dim=-1), torch.ones(16))
    assert torch.allclose(weights.double(), want_w, atol=1e-6)


def test_an_order_not_computed_in_the_method_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="routing order 'vllm' is not computed inside the method"):
        routing.select_in_method("vllm", 2, torch.zeros(1, EXPERTS))


def test_default_order_is_the_models_own() -> None:
    assert routing.default_order("gpt_oss") == "topk_softmax"
    assert routing.default_order("mixtral") == routing.default_order(None) == "softmax_topk"
    assert set(routing.IN_METHOD_ORDERS) == {"topk_softmax", "softmax_topk"}


def test_refusal_names_method_layer_and_features_for_in_method_orders_only() -> None:
    features = ["e_score_correction_bias", "routed_scaling_factor=2.5"]
    with pytest.raises(ValueError) as info:
        routing.check_in_method_routing("some_method", "topk_softmax", "model.layers.3.mlp.experts", features)
    assert str(info.value) == (
        "some_method: layer 'model.layers.3.mlp.experts' uses e_score_correction_bias, routed_scaling_factor=2.5, "
        "which routing='topk_softmax' (computed inside the method) does not implement; use routing: auto or vllm "
        "to let vLLM's router select the experts")
    for order in ("auto", "vllm"):
        routing.check_in_method_routing("some_method", order, "x", features)  # deferred, not refused
    routing.check_in_method_routing("some_method", "softmax_topk", "x", [])  # nothing to refuse


def test_to_local_linear_placement() -> None:
    ids = torch.tensor([[0, 5], [4, 7]], dtype=torch.int32)
    assert routing.to_local(ids, 4, 4).tolist() == [[-1, 1], [0, 3]]
    assert routing.to_local(ids, 0, 0).tolist() == ids.tolist()  # no placement known: unchanged
    assert routing.to_local(ids, 0, 4).tolist() == [[0, -1], [-1, -1]]


@needs_vllm
def test_unsupported_routing_reads_real_layers(harness: Any) -> None:
    plain = harness.build_routed(quant_config=None).experts
    assert routing.unsupported_routing(plain.moe_config, plain) == []
    assert routing.unsupported_routing(plain.moe_config, None) == []
    layer = harness.build_routed(quant_config=None, e_score_correction_bias=torch.linspace(-2.0, 2.0, EXPERTS),
                                 routed_scaling_factor=2.5).experts
    assert routing.unsupported_routing(layer.moe_config, layer) == ["e_score_correction_bias",
                                                                    "routed_scaling_factor=2.5"]
    sigmoid = harness.build_routed(quant_config=None, scoring_func="sigmoid").experts
    assert routing.unsupported_routing(sigmoid.moe_config, sigmoid) == [
        "scoring_func='sigmoid' (only softmax is computed in the method)"]


@needs_vllm
def test_local_expert_ids_follow_vllms_expert_map(harness: Any) -> None:
    from quantreg.testing.harness import method_factory

    ids = torch.tensor([[0, 5], [4, 7], [3, 1]])
    rank1 = harness.build(method_factory(_probe_class()), ep_size=2, ep_rank=1).experts
    assert rank1.expert_map is not None  # vLLM's own map for rank 1 of 2
    local = routing.local_expert_ids(rank1, ids)
    assert local.dtype == torch.int32
    assert local.tolist() == rank1.expert_map[ids].tolist() == [[-1, 1], [0, 3], [-1, -1]]
    whole = harness.build(method_factory(_probe_class())).experts
    assert routing.local_expert_ids(whole, ids).tolist() == ids.tolist()  # one rank: every id is local


class _Method(routing.InMethodRouting):
    def __init__(self, order: str) -> None:
        self._order = order

    def apply_monolithic(self) -> str:
        return "routed here"


def test_in_method_routing_defers_auto_refuses_explicit_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    logger = logging.getLogger("vllm.quantreg.test_routing")
    method = _Method("pending")
    method.defer_unsupported("some_method", "auto", [], "layer.0", logger)
    assert method.is_monolithic and method._select_monolithic()() == "routed here"
    with caplog.at_level(logging.INFO, logger="vllm.quantreg"):
        method.defer_unsupported("some_method", "auto", ["e_score_correction_bias"], "layer.0", logger)
        method.defer_unsupported("some_method", "auto", ["e_score_correction_bias"], "layer.0", logger)
    assert not method.is_monolithic and method._order == "vllm"
    assert [r.getMessage() for r in caplog.records] == [
        "some_method: layer 'layer.0' uses e_score_correction_bias: vLLM's router selects its experts (modular path)"]
    with pytest.raises(ValueError, match=r"^some_method: layer 'layer\.1' uses hash routing"):
        _Method("topk_softmax").defer_unsupported("some_method", "topk_softmax",
                                                  ["hash routing (hash_indices_table)"], "layer.1", logger)
