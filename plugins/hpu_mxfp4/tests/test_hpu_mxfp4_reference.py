"""The pure-torch reference kernels against a float64 evaluation on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from quantreg_hpu_mxfp4 import reference
from quantreg_hpu_mxfp4.testing import make_experts, make_tokens, oracle, rel_error

from quantreg.formats.mxfp4 import dequantize_mxfp4
from quantreg.models.gpt_oss import DEFAULT_ALPHA, DEFAULT_LIMIT

TOLERANCE = 1e-2  # max |out - float64| / max |float64|
MEASURED: dict[str, float] = {}


def run_mxfp4(x: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, experts, experts_min: int,
              activation: str = "silu") -> torch.Tensor:
    lists = experts.lists()
    experts_max = experts_min + experts.num_experts - 1
    if "w12_bias" in lists:
        return reference.bias_mxfp4_fused_weights(
            x, ids, rw, lists["w12"], lists["w3"], lists["w12_bias"], lists["w3_bias"], lists["d_scale_w12"],
            lists["d_scale_w3"], block_size=32, permuted_weights=True, experts_min=experts_min,
            experts_max=experts_max, alpha=DEFAULT_ALPHA, limit=DEFAULT_LIMIT)
    return reference.mxfp4_fused_weights(
        x, ids, rw, lists["w12"], lists["w3"], lists["d_scale_w12"], lists["d_scale_w3"], block_size=32,
        permuted_weights=True, activation=activation, experts_min=experts_min, experts_max=experts_max)


CASES = [
    # (hidden, intermediate, local experts, global experts, experts_min, tokens, top_k)
    pytest.param(64, 64, 4, 4, 0, 1, 1, id="tiny-1tok-top1"),
    pytest.param(64, 96, 4, 4, 0, 33, 2, id="tiny-33tok-top2"),
    pytest.param(128, 64, 8, 8, 0, 64, 4, id="small-64tok-top4"),
    pytest.param(96, 128, 3, 9, 3, 40, 3, id="ep-slice-mid-top3"),
    pytest.param(64, 64, 2, 8, 6, 25, 4, id="ep-slice-last-top4"),
    pytest.param(2880, 2880, 2, 4, 2, 1, 2, id="gptoss-2880-1tok"),
    pytest.param(2880, 2880, 2, 4, 0, 12, 4, id="gptoss-2880-12tok-top4"),
]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(("hidden", "inter", "local", "total", "lo", "tokens", "top_k"), CASES)
def test_matches_float64(bias: bool, hidden: int, inter: int, local: int, total: int, lo: int,
                         tokens: int, top_k: int) -> None:
    seed = hidden * 7 + inter + tokens * 13 + top_k + lo + int(bias)
    experts = make_experts(local, hidden, inter, bias=bias, seed=seed)
    x, ids, rw = make_tokens(tokens, hidden, total, top_k, seed=seed + 100)
    if total > local:  # make sure the slice is actually hit
        ids[0, 0] = lo if lo not in ids[0] else ids[0, 0]
    out = run_mxfp4(x, ids, rw, experts, lo)
    expected = oracle(x, ids, rw, experts, lo, activation="swigluoai" if bias else "silu")
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    error = rel_error(out, expected)
    MEASURED[f"{hidden}x{inter}/{tokens}tok/top{top_k}/{'bias' if bias else 'silu'}"] = error
    assert error <= TOLERANCE, error
    outside = ((ids < lo) | (ids > lo + local - 1)).all(dim=1)
    assert torch.equal(out[outside], torch.zeros_like(out[outside]))  # tokens routed elsewhere get 0


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_named_activations(activation: str) -> None:
    experts = make_experts(4, 64, 64, bias=False, seed=3)
    x, ids, rw = make_tokens(16, 64, 4, 2, seed=4)
    out = run_mxfp4(x, ids, rw, experts, 0, activation=activation)
    assert rel_error(out, oracle(x, ids, rw, experts, 0, activation=activation)) <= TOLERANCE


def test_extreme_scale_bytes_0_and_254() -> None:
    """Scale 0 (subnormal weights) and 254 (weights ~2**126) decode exactly and stay finite:
    the huge gate/up pre-activations are clamped by the SwiGLU-OAI limit like in float64."""
    experts = make_experts(2, 64, 64, bias=True, seed=21)
    experts.w13_scale[0, :, 0] = 0  # first block of every w13 row of expert 0: subnormals
    experts.w2_scale[1, :, 1] = 0
    row_blocks = experts.w13[1, :, :16]  # w13 rows of expert 1, first block: one code 0.5 each, scale 254
    row_blocks.zero_()
    row_blocks[:, 0] = 0x01
    experts.w13_scale[1, :, 0] = 254
    x, ids, rw = make_tokens(9, 64, 2, 2, seed=22)
    out = run_mxfp4(x, ids, rw, experts, 0)
    expected = oracle(x, ids, rw, experts, 0)
    assert torch.isfinite(out).all()
    assert rel_error(out, expected) <= TOLERANCE


def test_bf16_kernels_match_mxfp4_kernels_on_decoded_weights() -> None:
    experts = make_experts(3, 64, 64, bias=True, seed=8)
    x, ids, rw = make_tokens(10, 64, 3, 2, seed=9)
    lists = experts.lists()
    w12 = [dequantize_mxfp4(w, s) for w, s in zip(lists["w12"], lists["d_scale_w12"])]
    w3 = [dequantize_mxfp4(w, s) for w, s in zip(lists["w3"], lists["d_scale_w3"])]
    bf16 = reference.bias_fused_weights(x, ids.long(), rw, w12, w3, lists["w12_bias"], lists["w3_bias"],
                                        permuted_weights=True, experts_min=0, experts_max=2)
    assert torch.equal(bf16, run_mxfp4(x, ids, rw, experts, 0))
    plain = make_experts(3, 64, 64, bias=False, seed=8)
    p = plain.lists()
    w12 = [dequantize_mxfp4(w, s) for w, s in zip(p["w12"], p["d_scale_w12"])]
    w3 = [dequantize_mxfp4(w, s) for w, s in zip(p["w3"], p["d_scale_w3"])]
    bf16 = reference.fused_weights(x, ids.long(), rw, w12, w3, permuted_weights=True, activation="silu",
                                   experts_min=0, experts_max=2)
    assert torch.equal(bf16, run_mxfp4(x, ids, rw, plain, 0))


def test_decoded_weights_are_cached_per_weight_set() -> None:
    reference.CACHE.clear()
    experts = make_experts(4, 64, 64, bias=True, seed=1)
    x, ids, rw = make_tokens(6, 64, 4, 1, seed=2)
    ids[:] = 1  # only expert 1 is used: only its two projections get decoded
    run_mxfp4(x, ids, rw, experts, 0)
    assert len(reference.CACHE) == 2
    first = run_mxfp4(x, ids, rw, experts, 0)
    assert len(reference.CACHE) == 2
    experts.w2_scale[1].add_(1)  # an in-place reload bumps the version: decoded again
    second = run_mxfp4(x, ids, rw, experts, 0)
    assert len(reference.CACHE) == 3
    assert not torch.equal(first, second)


def test_contract_errors_are_clear() -> None:
    experts = make_experts(2, 64, 64, bias=False, seed=1)
    x, ids, rw = make_tokens(3, 64, 2, 1, seed=2)
    with pytest.raises(ValueError, match="names 3 local experts"):  # experts_min..max spans 3, 2 are given
        reference.mxfp4_fused_weights(
            x, ids, rw, tuple(experts.w13), tuple(experts.w2), tuple(experts.w13_scale), tuple(experts.w2_scale),
            block_size=32, permuted_weights=True, experts_min=0, experts_max=2)
    with pytest.raises(ValueError, match="block_size=32"):
        reference.mxfp4_fused_weights(x, ids, rw, tuple(experts.w13), tuple(experts.w2), tuple(experts.w13_scale),
                                      tuple(experts.w2_scale), block_size=16, permuted_weights=True,
                                      experts_min=0, experts_max=1)
    with pytest.raises(NotImplementedError):
        reference.fused_weights(x, ids, rw, [], [], permuted_weights=False, experts_min=0, experts_max=0)


def test_report_measured_tolerances(capsys: pytest.CaptureFixture[str]) -> None:
    """The summary line the README quotes: the worst error over the cases measured in this run, held
    to the bound. Run alone (no case measured yet), it measures one case itself."""
    if not MEASURED:
        test_matches_float64(True, 64, 64, 2, 2, 0, 7, 2)
    worst = max(MEASURED.items(), key=lambda kv: kv[1])
    assert 0 < worst[1] <= TOLERANCE, worst  # exact zero would mean the comparison compared nothing
    with capsys.disabled():
        print(f"\nreference vs float64: worst rel error {worst[1]:.2e} ({worst[0]}) over {len(MEASURED)} cases")
