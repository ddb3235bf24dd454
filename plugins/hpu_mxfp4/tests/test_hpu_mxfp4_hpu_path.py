"""The Gaudi methods run on this CPU through test doubles of the Gaudi stack
(:mod:`quantreg_hpu_mxfp4.testing`, installed by the fixtures of conftest.py).

The doubles assert the kernel contract; these tests check the method feeds them correctly
(routing, EP range, DP dispatch, dtypes, views) and that the numbers are the reference's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
from quantreg_hpu_mxfp4 import method as methods
from quantreg_hpu_mxfp4 import probe, reference
from quantreg_hpu_mxfp4.testing import FakeLayer, make_experts, make_tokens, moe_config, oracle, rel_error

from quantreg.formats.mxfp4 import dequantize_mxfp4_f64
from quantreg.models.gpt_oss import DEFAULT_ALPHA, DEFAULT_LIMIT

pytestmark = pytest.mark.vllm  # imports vLLM (the classes subclass its MXFP4 method)

GLOBAL, LOCAL, TOP_K, HIDDEN, INTER = 8, 4, 2, 64, 64


def route(logits: torch.Tensor, order: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The seed's routing, written out independently of the plugin."""
    if order == "topk_softmax":
        weights, ids = torch.topk(logits, TOP_K, dim=-1)
        weights = torch.softmax(weights, dim=-1, dtype=torch.float32)
    else:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, TOP_K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(torch.bfloat16), ids.to(torch.int32)


def expected(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Any, experts_min: int) -> torch.Tensor:
    lists = experts.lists()
    hi = experts_min + experts.num_experts - 1
    if "w12_bias" in lists:
        return reference.bias_mxfp4_fused_weights(
            x, ids, weights, lists["w12"], lists["w3"], lists["w12_bias"], lists["w3_bias"], lists["d_scale_w12"],
            lists["d_scale_w3"], block_size=32, permuted_weights=True, experts_min=experts_min, experts_max=hi)
    return reference.mxfp4_fused_weights(
        x, ids, weights, lists["w12"], lists["w3"], lists["d_scale_w12"], lists["d_scale_w3"], block_size=32,
        permuted_weights=True, activation="silu", experts_min=experts_min, experts_max=hi)


def build(cls: type, *, bias: bool, ep_rank: int = 0, dp_size: int = 1, config: Any = None,
          grouped: bool = False, seed: int = 0, **options: Any) -> tuple[Any, FakeLayer, Any]:
    """Construct ``cls(moe_config, **options)`` (inside ``config`` if given) and a loaded layer."""
    from vllm.config import set_current_vllm_config

    moe = moe_config(num_global=GLOBAL, num_local=LOCAL, top_k=TOP_K, hidden=HIDDEN, intermediate=INTER,
                     bias=bias, activation="swigluoai" if bias else "silu", ep_rank=ep_rank, dp_size=dp_size)
    experts = make_experts(LOCAL, HIDDEN, INTER, bias=bias, seed=seed)
    context = set_current_vllm_config(config) if config is not None else contextlib.nullcontext()
    with context:
        method = cls(moe, **options)
    layer = FakeLayer(method, moe, experts, use_grouped_topk=grouped)
    return method, layer, experts


@pytest.mark.parametrize("dp_size", [1, 2])
@pytest.mark.parametrize("ep_rank", [0, 1])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("model", ["gpt_oss", "generic"])
def test_native_method_on_doubles(hpu: Any, vllm_gaudi: Any, gpt_oss_vllm_config: Any, model: str, bias: bool,
                                  ep_rank: int, dp_size: int) -> None:
    config = gpt_oss_vllm_config if model == "gpt_oss" else None
    method, layer, experts = build(methods.HpuMxfp4MoEMethod, bias=bias, ep_rank=ep_rank, dp_size=dp_size,
                                   config=config, seed=ep_rank * 10 + dp_size)
    assert method.model_type == ("gpt_oss" if model == "gpt_oss" else None)
    assert method.is_monolithic and hpu.synchronized == 1
    order = "topk_softmax" if model == "gpt_oss" else "softmax_topk"
    g = torch.Generator().manual_seed(5)
    shape = (2, 3, HIDDEN) if dp_size == 1 else (6, HIDDEN)  # vLLM hands [tokens, hidden]; DP needs that form
    x = torch.randn(*shape, generator=g).to(torch.bfloat16)
    logits = torch.randn(6, GLOBAL, generator=g)
    px, pids, pw = make_tokens(4, HIDDEN, GLOBAL, TOP_K, seed=6)
    if dp_size > 1:
        vllm_gaudi.peers = [px, pids, pw]

    out = method.apply_monolithic(layer, x, logits)

    weights, ids = route(logits, order)
    flat = x.view(-1, HIDDEN)
    if dp_size > 1:
        flat, ids, weights = torch.cat([flat, px]), torch.cat([ids, pids]), torch.cat([weights, pw])
        assert out.shape == (10, HIDDEN)  # seed's shape: (gathered tokens, *input_shape[1:])
        assert vllm_gaudi.dispatched == [(torch.bfloat16, False), (torch.int32, False), (torch.bfloat16, False)]
    else:
        assert out.shape == x.shape
    want = expected(flat, ids, weights, experts, ep_rank * LOCAL)
    assert torch.equal(out.reshape(-1, HIDDEN), want)

    (call,) = hpu.calls
    assert call.name == ("bias_mxfp4_fused_weights" if bias else "mxfp4_fused_weights")
    assert call.kwargs["experts_min"] == ep_rank * LOCAL and call.kwargs["experts_max"] == ep_rank * LOCAL + LOCAL - 1
    assert torch.equal(call.args[1], ids)
    if bias:
        assert (call.kwargs["alpha"], call.kwargs["limit"]) == (DEFAULT_ALPHA, DEFAULT_LIMIT)
    else:
        assert call.kwargs["activation"] == "silu"
    assert hpu.compiled == ["forward"]  # compiled once, through hpu_backend
    for e in range(LOCAL):  # the kernel sees views of the layer's parameters, not copies
        assert call.args[3][e].data_ptr() == layer.w13_weight.data[e].data_ptr()
        assert call.args[4][e].data_ptr() == layer.w2_weight.data[e].data_ptr()
    if dp_size == 1:  # a second call reuses the compiled forward
        method.apply_monolithic(layer, x, logits)
        assert hpu.compiled == ["forward"]


def test_native_output_is_within_tolerance_of_float64(hpu: Any, vllm_gaudi: Any, gpt_oss_vllm_config: Any) -> None:
    method, layer, experts = build(methods.HpuMxfp4MoEMethod, bias=True, ep_rank=1, config=gpt_oss_vllm_config)
    logits = torch.randn(12, GLOBAL, generator=torch.Generator().manual_seed(1))
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out = method.apply_monolithic(layer, x, logits)
    weights, ids = route(logits, "topk_softmax")
    assert rel_error(out, oracle(x, ids, weights, experts, LOCAL)) <= 1e-2


def test_dp_gather_buffers_get_matching_dtypes(hpu: Any, vllm_gaudi: Any) -> None:
    """vllm-gaudi's preallocated ids buffer is int64: ids are dispatched as int64, then narrowed."""
    method, layer, _ = build(methods.HpuMxfp4MoEMethod, bias=True, dp_size=2)
    x, _, _ = make_tokens(3, HIDDEN, GLOBAL, TOP_K, seed=1)
    px, pids, pw = make_tokens(3, HIDDEN, GLOBAL, TOP_K, seed=2)
    vllm_gaudi.peers = [px, pids, pw]
    vllm_gaudi.metadata = type("Meta", (), {
        "hidden_states_across_dp": torch.empty(6, HIDDEN, dtype=torch.bfloat16),
        "topk_ids_across_dp": torch.empty(6, TOP_K, dtype=torch.int64),
        "topk_weights_across_dp": torch.empty(6, TOP_K, dtype=torch.bfloat16),
    })()
    out = method.apply_monolithic(layer, x, torch.randn(3, GLOBAL))
    assert out.shape == (6, HIDDEN)
    assert [d for d, _ in vllm_gaudi.dispatched] == [torch.bfloat16, torch.int64, torch.bfloat16]
    assert hpu.calls[0].args[1].dtype == torch.int32


def test_grouped_routing_defers_to_vllms_router(hpu: Any, vllm_gaudi: Any) -> None:
    """vLLM 0.32's RoutedExperts has no ``router``: grouped/custom routing makes the method modular."""
    method, layer, experts = build(methods.HpuMxfp4MoEMethod, bias=False, grouped=True)
    assert not method.is_monolithic
    x, ids, weights = make_tokens(5, HIDDEN, GLOBAL, TOP_K, id_high=LOCAL, seed=3)
    out = method.apply(layer, x, weights.float(), ids.long(), None, None)  # what vLLM's router hands over
    assert torch.equal(out, expected(x, ids, weights, experts, 0))
    assert hpu.calls[0].args[1].dtype == torch.int32


def test_chunk_tuning_comes_from_vllm_gaudi(hpu: Any, vllm_gaudi: Any) -> None:
    vllm_gaudi.moe_chunk, vllm_gaudi.moe_token_boundary = [64, 256], [4, 1024]
    method, layer, _ = build(methods.HpuMxfp4MoEMethod, bias=True)
    method.apply_monolithic(layer, torch.randn(3, HIDDEN).to(torch.bfloat16), torch.randn(3, GLOBAL))
    method.apply_monolithic(layer, torch.randn(9, HIDDEN).to(torch.bfloat16), torch.randn(9, GLOBAL))
    assert [(c.kwargs["chunk_size"], c.kwargs["total_experts"]) for c in hpu.calls] == [(64, GLOBAL), (256, GLOBAL)]


def test_options_reach_the_kernel_and_bad_ones_are_named(hpu: Any, vllm_gaudi: Any) -> None:
    method, layer, _ = build(methods.HpuMxfp4MoEMethod, bias=True, alpha=1.5, limit=5.0, routing="topk_softmax")
    method.apply_monolithic(layer, torch.randn(2, HIDDEN).to(torch.bfloat16), torch.randn(2, GLOBAL))
    assert (hpu.calls[0].kwargs["alpha"], hpu.calls[0].kwargs["limit"]) == (1.5, 5.0)
    moe = moe_config(num_global=GLOBAL, num_local=LOCAL, top_k=TOP_K, hidden=HIDDEN, intermediate=INTER, bias=True)
    with pytest.raises(TypeError, match=r"'hpu_mxfp4' got unknown option\(s\) 'chunk', 'limt'; accepted: alpha"):
        methods.HpuMxfp4MoEMethod(moe, limt=7.0, chunk=3)
    with pytest.raises(ValueError, match="routing='fast'"):
        methods.Mxfp4ReferenceMoEMethod(moe, routing="fast")
    with pytest.raises(ValueError, match="alpha=-1"):
        methods.HpuMxfp4DequantMoEMethod(moe, alpha=-1)


def test_dequant_method_bf16_weights_equal_the_reference_decode(hpu: Any, vllm_gaudi: Any,
                                                                 gpt_oss_vllm_config: Any) -> None:
    native, native_layer, experts = build(methods.HpuMxfp4MoEMethod, bias=True, ep_rank=1,
                                          config=gpt_oss_vllm_config, seed=4)
    method, layer, _ = build(methods.HpuMxfp4DequantMoEMethod, bias=True, ep_rank=1,
                             config=gpt_oss_vllm_config, seed=4)
    for name, packed, scale in (("w13", experts.w13, experts.w13_scale), ("w2", experts.w2, experts.w2_scale)):
        weight = getattr(layer, f"{name}_weight")
        assert weight.dtype == torch.bfloat16
        decoded = dequantize_mxfp4_f64(packed, scale).to(torch.bfloat16)
        assert torch.equal(weight.data.view(torch.int16), decoded.view(torch.int16))
        assert not hasattr(layer, f"{name}_weight_scale")
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    logits = torch.randn(7, GLOBAL, generator=torch.Generator().manual_seed(4))
    out = method.apply_monolithic(layer, x, logits)
    call = hpu.calls[-1]
    assert call.name == "bias_fused_weights" and call.args[1].dtype == torch.int64
    assert call.args[3][0].data_ptr() == layer.w13_weight.data[0].data_ptr()
    assert hpu.compiled == []  # the bf16 kernels run eagerly, as vllm-gaudi calls them
    assert torch.equal(out, native.apply_monolithic(native_layer, x, logits))


def test_dequant_method_without_bias_uses_fused_weights(hpu: Any, vllm_gaudi: Any) -> None:
    method, layer, _ = build(methods.HpuMxfp4DequantMoEMethod, bias=False)
    x, _, _ = make_tokens(4, HIDDEN, GLOBAL, TOP_K, seed=8)
    out = method.apply_monolithic(layer, x, torch.randn(4, GLOBAL))
    assert hpu.calls[-1].name == "fused_weights" and hpu.calls[-1].kwargs["activation"] == "silu"
    assert out.shape == x.shape


def test_reference_method_needs_no_gaudi_stack() -> None:
    """mxfp4_reference: same class, reference kernels, no HPU imports, no DP dispatch of its own."""
    method, layer, experts = build(methods.Mxfp4ReferenceMoEMethod, bias=True, ep_rank=1, dp_size=2)
    x, _, _ = make_tokens(5, HIDDEN, GLOBAL, TOP_K, seed=1)
    logits = torch.randn(5, GLOBAL, generator=torch.Generator().manual_seed(9))
    out = method.apply_monolithic(layer, x, logits)
    weights, ids = route(logits, "softmax_topk")
    assert torch.equal(out, expected(x, ids, weights, experts, LOCAL))


def test_probes(hpu: Any) -> None:
    assert probe.native_mxfp4_available()[0] and probe.bf16_moe_available()[0]
    hpu.missing_ops = {"bias_mxfp4_fused_weights"}
    ok, reason = probe.native_mxfp4_available()
    assert not ok and "lacks bias_mxfp4_fused_weights" in reason
    assert probe.bf16_moe_available()[0]
    hpu.available = False
    ok, reason = probe.bf16_moe_available()
    assert not ok and reason == "no HPU device visible to this process"


@pytest.mark.skipif(importlib.util.find_spec("habana_frameworks") is not None, reason="a Gaudi stack is installed")
def test_probe_without_gaudi_stack_is_quick_and_clear() -> None:
    import time

    start = time.perf_counter()
    ok, reason = probe.native_mxfp4_available()
    assert not ok and reason.startswith("no HPU: habana_frameworks")
    assert time.perf_counter() - start < 0.5


def test_native_env_is_logged_not_obeyed(hpu: Any, vllm_gaudi: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.quantreg.hpu_mxfp4")
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "level", logging.INFO)
    monkeypatch.setattr(methods, "_explained", set())
    monkeypatch.setenv("HPU_MXFP4_NATIVE", "0")
    try:
        build(methods.HpuMxfp4MoEMethod, bias=True)
        build(methods.HpuMxfp4MoEMethod, bias=True)  # once per process and method
    finally:
        logger.removeHandler(handler)
    (record,) = records
    assert "HPU_MXFP4_NATIVE=0 would select dequantising" in record.getMessage()
    assert "table decides here and chose 'hpu_mxfp4'" in record.getMessage()


def test_bias_with_a_plain_activation_is_refused(hpu: Any, vllm_gaudi: Any) -> None:
    moe = moe_config(num_global=GLOBAL, num_local=LOCAL, top_k=TOP_K, hidden=HIDDEN, intermediate=INTER, bias=True,
                     activation="silu")
    method = methods.HpuMxfp4MoEMethod(moe)
    with pytest.raises(ValueError, match="SwiGLU-OAI only"):
        FakeLayer(method, moe, make_experts(LOCAL, HIDDEN, INTER, bias=True, seed=1))


def test_doubles_do_not_leak() -> None:
    import sys

    assert "habana_frameworks" not in sys.modules and "vllm_gaudi" not in sys.modules
    assert type(getattr(torch, "hpu", None)).__name__ != "_FakeHpuModule"
    assert not hasattr(getattr(torch.ops, "hpu", None), "mixture_of_experts")
    assert torch.compile.__module__.startswith("torch")
