"""``hpu_mxfp4_dequant`` option ``max_experts_per_slice``: vllm-gaudi's MAX_EXPERTS_PER_SLICE, on the doubles.

The HPU doubles (conftest.py) assert each kernel call's contract, including that every tuple
has exactly ``experts_max - experts_min + 1`` experts, so a slice whose range and tensors
disagree fails inside the kernel double.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
from quantreg_hpu_mxfp4 import method as methods
from quantreg_hpu_mxfp4 import reference
from quantreg_hpu_mxfp4.options import MethodOptions
from quantreg_hpu_mxfp4.testing import FakeLayer, make_experts, make_tokens, moe_config

pytestmark = pytest.mark.vllm

GLOBAL, LOCAL, TOP_K, HIDDEN, INTER = 16, 8, 4, 64, 64
EP_RANK = 1  # local experts are global 8..15, so slice ranges must be offset


def build(bias: bool, **options: Any) -> tuple[Any, FakeLayer]:
    moe = moe_config(num_global=GLOBAL, num_local=LOCAL, top_k=TOP_K, hidden=HIDDEN, intermediate=INTER, bias=bias,
                     activation="swigluoai" if bias else "silu", ep_rank=EP_RANK, dp_size=1)
    method = methods.HpuMxfp4DequantMoEMethod(moe, **options)
    return method, FakeLayer(method, moe, make_experts(LOCAL, HIDDEN, INTER, bias=bias, seed=11))


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    x, _, _ = make_tokens(9, HIDDEN, GLOBAL, TOP_K, seed=2)
    return x, torch.randn(9, GLOBAL, generator=torch.Generator().manual_seed(6))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(("most", "ranges"), [(3, [(8, 10), (11, 13), (14, 15)]), (4, [(8, 11), (12, 15)])])
def test_slices_cover_every_local_expert_once(hpu: Any, vllm_gaudi: Any, bias: bool, most: int,
                                              ranges: list[tuple[int, int]]) -> None:
    whole, whole_layer = build(bias, max_experts_per_slice=0)
    sliced, layer = build(bias, max_experts_per_slice=most)
    x, logits = tokens()
    expected = whole.apply_monolithic(whole_layer, x, logits)
    hpu.calls.clear()
    out = sliced.apply_monolithic(layer, x, logits)
    name = "bias_fused_weights" if bias else "fused_weights"
    assert [c.name for c in hpu.calls] == [name] * len(ranges)
    assert [(c.kwargs["experts_min"], c.kwargs["experts_max"]) for c in hpu.calls] == ranges
    for call, (lo, _hi) in zip(hpu.calls, ranges):  # each slice gets the views of its own experts
        assert call.args[3][0].data_ptr() == layer.w13_weight.data[lo - LOCAL * EP_RANK].data_ptr()
        if bias:
            assert call.args[5][0].data_ptr() == layer.w13_bias.data[lo - LOCAL * EP_RANK].data_ptr()
    # exactly the sum of the per-slice kernel outputs (what vllm-gaudi's += computes) ...
    parts = [reference_call(call) for call in hpu.calls]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    assert torch.equal(out, total)
    # ... and the unsliced result up to bf16 rounding of the partial sums
    assert torch.allclose(out.float(), expected.float(), rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def reference_call(call: Any) -> torch.Tensor:
    result: torch.Tensor = getattr(reference, call.name)(*call.args, **call.kwargs)
    return result


def test_no_slicing_when_the_experts_fit(hpu: Any, vllm_gaudi: Any) -> None:
    method, layer = build(True, max_experts_per_slice=LOCAL)
    method.apply_monolithic(layer, *tokens())
    assert [(c.kwargs["experts_min"], c.kwargs["experts_max"]) for c in hpu.calls] == [(8, 15)]
    assert layer.moe_op.slices() == [(0, LOCAL)]


def test_unset_option_follows_vllm_gaudis_environment_variable(hpu: Any, vllm_gaudi: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAX_EXPERTS_PER_SLICE", "5")
    method, layer = build(False)
    method.apply_monolithic(layer, *tokens())
    assert [(c.kwargs["experts_min"], c.kwargs["experts_max"]) for c in hpu.calls] == [(8, 12), (13, 15)]
    monkeypatch.setenv("MAX_EXPERTS_PER_SLICE", "64x")  # vllm-gaudi: invalid -> -1 -> no slicing
    assert MethodOptions.parse("hpu_mxfp4_dequant", {}).experts_per_slice() == 0
    monkeypatch.setenv("MAX_EXPERTS_PER_SLICE", "2")
    assert MethodOptions.parse("hpu_mxfp4_dequant", {"max_experts_per_slice": 0}).experts_per_slice() == 0


def test_native_mxfp4_methods_never_slice_and_reject_the_option(hpu: Any, vllm_gaudi: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAX_EXPERTS_PER_SLICE", "2")
    moe = moe_config(num_global=GLOBAL, num_local=LOCAL, top_k=TOP_K, hidden=HIDDEN, intermediate=INTER, bias=True,
                     activation="swigluoai", ep_rank=EP_RANK, dp_size=1)
    native = methods.HpuMxfp4MoEMethod(moe)
    layer = FakeLayer(native, moe, make_experts(LOCAL, HIDDEN, INTER, bias=True, seed=11))
    native.apply_monolithic(layer, *tokens())
    assert [c.name for c in hpu.calls] == ["bias_mxfp4_fused_weights"]
    with pytest.raises(TypeError, match=r"unknown option\(s\) 'max_experts_per_slice'"):
        methods.HpuMxfp4MoEMethod(moe, max_experts_per_slice=4)
    with pytest.raises(ValueError, match="max_experts_per_slice=-1 must be an integer >= 0"):
        methods.HpuMxfp4DequantMoEMethod(moe, max_experts_per_slice=-1)
    with pytest.raises(ValueError, match="max_experts_per_slice=True"):
        methods.HpuMxfp4DequantMoEMethod(moe, max_experts_per_slice=True)
