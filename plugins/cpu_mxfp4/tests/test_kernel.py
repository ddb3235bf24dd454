"""Correctness of the compiled MXFP4 MoE kernel against float64 (speed lives in bench/).

Every case runs on both ISA paths (``QUANTREG_CPU_MXFP4_ISA``: the ``isa`` fixture of this
directory's conftest.py); the AVX-512 one is skipped, with the reason, on hosts without AVX-512
F/BW/VL/VNNI (the prefill callback's signal handling: test_kernel_callback.py). The project's
tolerance is a relative error (:func:`relative_error`, max abs error / max abs reference) of 0.02
against float64; the kernel's
budget (see ``quantreg_cpu_mxfp4.kernel``): the default ``q8x2`` activations are held to the 1 %
aim (``TOL``), plain ``q8`` (0.8-1.9 % measured on these experts) to the 2 % tolerance (``TOL_Q8``).
"""

from __future__ import annotations

import pytest
import torch
from cpu_mxfp4_kernel_support import AVX512_FLAGS, cpu_flags, pack, routing, silu_moe_f64
from quantreg_cpu_mxfp4 import kernel

from quantreg.formats.mxfp4 import dequantize_mxfp4_f64, random_mxfp4
from quantreg.models.gpt_oss_moe import (
    random_gpt_oss_mxfp4_experts,
    random_hidden_states,
    relative_error,
    swiglu_oai,
)

TOL = 0.01
TOL_Q8 = 0.02
@pytest.mark.parametrize("tokens", [1, 3, 16, 64, 300])
def test_swigluoai_with_biases_matches_float64(isa: str, tokens: int) -> None:
    ex = random_gpt_oss_mxfp4_experts(8, 96, 160, bias=True, seed=tokens)  # K = 96 / 160: partial groups
    x = random_hidden_states(tokens, 96, seed=tokens + 1)
    ids, weights = routing(tokens, 8, 4, seed=tokens + 2, out_of_range=True)
    w13, w2 = pack(ex)
    out = kernel.moe_forward(x, ids, weights, w13, ex.w13_bias, w2, ex.w2_bias, activation="swigluoai")
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    err = relative_error(out, ex.reference(x, ids, weights))
    assert err <= TOL, f"{isa}, T={tokens}: relative error {err:.4f} > {TOL}"


@pytest.mark.parametrize("tokens", [1, 16, 300])
@pytest.mark.parametrize(("hidden", "inter"), [(64, 96), (224, 32)])
def test_silu_without_biases_matches_float64(isa: str, tokens: int, hidden: int, inter: int) -> None:
    w13_b, w13_s = random_mxfp4((8, 2 * inter, hidden), seed=hidden + tokens)
    w2_b, w2_s = random_mxfp4((8, hidden, inter), seed=hidden + tokens + 1, scale_range=(118, 122))
    x = random_hidden_states(tokens, hidden, seed=3)
    ids, weights = routing(tokens, 8, 2, seed=tokens, out_of_range=True)
    out = kernel.moe_forward(x, ids.long(), weights, kernel.PackedExperts.from_vllm(w13_b, w13_s), None,
                             kernel.PackedExperts.from_vllm(w2_b, w2_s), None, activation="silu")
    ref = silu_moe_f64(x, ids, weights, dequantize_mxfp4_f64(w13_b, w13_s), dequantize_mxfp4_f64(w2_b, w2_s))
    err = relative_error(out, ref)
    assert err <= TOL, f"{isa}, T={tokens}, H={hidden}, I={inter}: relative error {err:.4f} > {TOL}"


@pytest.mark.parametrize("tokens", [1, 16])
def test_plain_q8_within_tolerance(isa: str, tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernel.PRECISION_ENV, "q8")
    assert kernel.precision() == "q8"
    ex = random_gpt_oss_mxfp4_experts(8, 96, 160, bias=True, seed=tokens)
    x = random_hidden_states(tokens, 96, seed=tokens + 1)
    ids, weights = routing(tokens, 8, 4, seed=tokens + 2, out_of_range=True)
    w13, w2 = pack(ex)
    out = kernel.moe_forward(x, ids, weights, w13, ex.w13_bias, w2, ex.w2_bias)
    err = relative_error(out, ex.reference(x, ids, weights))
    assert err <= TOL_Q8, f"{isa}, q8, T={tokens}: relative error {err:.4f} > {TOL_Q8}"


def test_a_rules_precision_takes_precedence_over_the_process_default(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``precision=`` (a rule's option, passed by the method) gives exactly the bytes the process default
    gives for that precision, whatever the environment says; a value outside PRECISIONS is refused."""
    ex = random_gpt_oss_mxfp4_experts(8, 96, 160, bias=True, seed=11)
    x = random_hidden_states(3, 96, seed=12)
    ids, weights = routing(3, 8, 4, seed=13, out_of_range=False)
    w13, w2 = pack(ex)
    by_env = {}
    for prec in kernel.PRECISIONS:
        monkeypatch.setenv(kernel.PRECISION_ENV, prec)
        by_env[prec] = kernel.moe_forward(x, ids, weights, w13, ex.w13_bias, w2, ex.w2_bias)
    assert not torch.equal(by_env["q8"], by_env["q8x2"])  # the two settings differ on these inputs
    for prec in kernel.PRECISIONS:
        other = next(p for p in kernel.PRECISIONS if p != prec)
        monkeypatch.setenv(kernel.PRECISION_ENV, other)
        out = kernel.moe_forward(x, ids, weights, w13, ex.w13_bias, w2, ex.w2_bias, precision=prec)
        assert torch.equal(out, by_env[prec]), prec
    with pytest.raises(ValueError, match="precision must be one of"):
        kernel.moe_forward(x, ids, weights, w13, ex.w13_bias, w2, ex.w2_bias, precision="q4")


# The prefill path: exact bf16 weights, bf16 activations and GEMM outputs -- the error of a torch
# bf16 MoE on the dequantised weights (mxfp4_reference's scheme). Measured on the cases below:
# swigluoai 0.47 %, silu 0.68 % (a torch bf16 loop on the same inputs: 0.68 % as well).
TOL_GEMM = 0.01


@pytest.mark.parametrize("activation", ["swigluoai", "silu"])
def test_prefill_gemm_path_matches_float64(isa: str, activation: str) -> None:
    """300 tokens on 8 experts (~150 per expert), every expert pinned to the GEMM path (bf16 or fp32)."""
    ex = random_gpt_oss_mxfp4_experts(8, 96, 160, bias=activation == "swigluoai", seed=21)
    x = random_hidden_states(300, 96, seed=22)
    ids, weights = routing(300, 8, 4, seed=23, out_of_range=True)
    w13, w2 = pack(ex)
    out = kernel.moe_forward(x, ids, weights, w13, ex.w13_bias, w2, ex.w2_bias, activation=activation,
                             gemm_min_tokens=1)
    if activation == "swigluoai":
        ref = ex.reference(x, ids, weights)
    else:
        ref = silu_moe_f64(x, ids, weights, dequantize_mxfp4_f64(ex.w13_weight, ex.w13_weight_scale),
                           dequantize_mxfp4_f64(ex.w2_weight, ex.w2_weight_scale))
    err = relative_error(out, ref)
    assert err <= TOL_GEMM, f"{isa}, {activation}, GEMM path: relative error {err:.4f} > {TOL_GEMM}"


def test_prefill_gemm_dtype_follows_the_cpu(isa: str) -> None:
    """fp32 tiles and tokens (AVX2, or a CPU without AVX-512 BF16): the GEMM path is exact to fp32
    accumulation (~1e-6 measured); bf16 (the avx512 path with AVX-512 BF16): a bf16 MoE's error."""
    ex = random_gpt_oss_mxfp4_experts(8, 256, 192, bias=True, seed=41)
    x = random_hidden_states(200, 256, seed=42).float()
    ids, weights = routing(200, 8, 4, seed=43)
    w13, w2 = pack(ex)
    out = kernel.moe_forward(x, ids, weights, w13, ex.w13_bias, w2, ex.w2_bias, gemm_min_tokens=1)
    err = relative_error(out, ex.reference(x, ids, weights))
    bf16 = isa == "avx512" and kernel._supports("avx512_bf16")
    print(f"{isa}: GEMM in {'bf16' if bf16 else 'fp32'}, relative error {err:.2e}")
    assert err <= (TOL_GEMM if bf16 else 1e-5)
    assert bf16 or err > 0  # a measured error, not a copy of the reference


def test_many_tokens_on_the_int8_path_still_match(isa: str) -> None:
    """The same 300 tokens pinned to the Q8 GEMV (gemm_min_tokens=0): its token tiles stay covered."""
    ex = random_gpt_oss_mxfp4_experts(8, 96, 160, bias=True, seed=21)
    x = random_hidden_states(300, 96, seed=22)
    ids, weights = routing(300, 8, 4, seed=23, out_of_range=True)
    w13, w2 = pack(ex)
    out = kernel.moe_forward(x, ids, weights, w13, ex.w13_bias, w2, ex.w2_bias, gemm_min_tokens=0)
    err = relative_error(out, ex.reference(x, ids, weights))
    assert err <= TOL, f"{isa}, int8 path at 300 tokens: relative error {err:.4f} > {TOL}"


def test_mixed_batch_takes_both_paths(isa: str) -> None:
    """Experts 0-1 get 200 tokens each (GEMM path), experts 2-7 get 2-3 each (int8 GEMV), one call.

    Tokens routed only to GEMM experts must give what the all-GEMM call gives, tokens routed only to
    GEMV experts exactly what the all-GEMV call gives: each expert took the path its count says.
    """
    ex = random_gpt_oss_mxfp4_experts(8, 96, 160, bias=True, seed=31)
    big_tokens, small_tokens = 200, 8
    x = random_hidden_states(big_tokens + small_tokens, 96, seed=32)
    g = torch.Generator().manual_seed(33)
    big_ids = torch.tensor([[0, 1]] * big_tokens)
    small_ids = torch.stack([2 + torch.randperm(6, generator=g)[:2] for _ in range(small_tokens)])
    ids = torch.cat([big_ids, small_ids]).to(torch.int32)
    weights = torch.softmax(torch.randn(ids.shape, generator=g), dim=-1)
    counts = torch.bincount(ids.flatten().long(), minlength=8)
    threshold = kernel.GEMM_MIN_TOKENS[kernel.precision()]
    assert (counts[:2] >= threshold).all() and (counts[2:] < threshold).all(), counts
    w13, w2 = pack(ex)
    args = (x, ids, weights, w13, ex.w13_bias, w2, ex.w2_bias)
    mixed = kernel.moe_forward(*args)
    all_gemm = kernel.moe_forward(*args, gemm_min_tokens=1)
    all_gemv = kernel.moe_forward(*args, gemm_min_tokens=0)
    assert relative_error(mixed, ex.reference(x, ids, weights)) <= TOL
    assert torch.equal(mixed[big_tokens:], all_gemv[big_tokens:])
    assert relative_error(mixed[:big_tokens], all_gemm[:big_tokens]) <= 1e-3
    # and the two paths really differ (bf16 vs Q8 activations), so the checks above tell them apart
    assert not torch.equal(all_gemm[:big_tokens], all_gemv[:big_tokens])


def test_out_of_range_ids_contribute_nothing(isa: str) -> None:
    ex = random_gpt_oss_mxfp4_experts(4, 64, 64, bias=True, seed=5)
    x = random_hidden_states(3, 64, seed=6)
    w13, w2 = pack(ex)
    weights = torch.full((3, 2), 0.5)
    ids = torch.tensor([[-1, 4], [7, -100], [1, 9]], dtype=torch.int32)  # token 2 keeps expert 1 only
    out = kernel.moe_forward(x, ids, weights, w13, ex.w13_bias, w2, ex.w2_bias)
    assert torch.equal(out[:2], torch.zeros(2, 64, dtype=torch.bfloat16))
    assert relative_error(out, ex.reference(x, ids, weights)) <= TOL
    assert out[2].abs().max() > 0


def test_isa_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same integer dot products on both paths; only the fp32 summation order differs."""
    if not AVX512_FLAGS <= cpu_flags():
        pytest.skip("needs both ISA paths (this CPU lacks AVX-512 F/BW/VL/VNNI)")
    ex = random_gpt_oss_mxfp4_experts(8, 160, 96, bias=True, seed=11)
    x = random_hidden_states(20, 160, seed=12)
    ids, weights = routing(20, 8, 4, seed=13)
    w13, w2 = pack(ex)
    outs = []
    for path in ("avx2", "avx512"):
        monkeypatch.setenv(kernel.ISA_ENV, path)
        outs.append(kernel.moe_forward(x, ids, weights, w13, ex.w13_bias, w2, ex.w2_bias).float())
    assert relative_error(outs[0], outs[1]) <= 1e-2 / 2


def test_empty_and_no_routed_tokens(isa: str) -> None:
    ex = random_gpt_oss_mxfp4_experts(2, 32, 32, bias=False, seed=1)
    w13, w2 = pack(ex)
    empty = kernel.moe_forward(torch.zeros(0, 32, dtype=torch.bfloat16), torch.zeros(0, 2, dtype=torch.int32),
                               torch.zeros(0, 2), w13, None, w2, None)
    assert empty.shape == (0, 32)
    x = random_hidden_states(2, 32, seed=2)
    none = kernel.moe_forward(x, torch.full((2, 2), 5, dtype=torch.int32), torch.ones(2, 2), w13, None, w2, None)
    assert torch.equal(none, torch.zeros_like(x))


def test_bad_inputs_raise_clear_errors(isa: str) -> None:
    ex = random_gpt_oss_mxfp4_experts(2, 96, 32, bias=True, seed=1)  # w13_bias [2, 64], w2_bias [2, 96]
    w13, w2 = pack(ex)
    x = random_hidden_states(2, 96, seed=2)
    ids, weights = routing(2, 2, 2, seed=3)
    with pytest.raises(RuntimeError, match="hidden size"):
        kernel.moe_forward(random_hidden_states(2, 64, seed=2), ids, weights, w13, None, w2, None)
    with pytest.raises(RuntimeError, match="w13_bias"):
        kernel.moe_forward(x, ids, weights, w13, ex.w2_bias, w2, None)
    with pytest.raises(RuntimeError, match="topk_ids"):
        kernel.moe_forward(x, ids.float(), weights, w13, None, w2, None)
    with pytest.raises(ValueError, match="activation"):
        kernel.moe_forward(x, ids, weights, w13, None, w2, None, activation="gelu")
    # w13 and w2 swapped: 2I rows of K=H against I rows
    with pytest.raises(RuntimeError, match="w13"):
        kernel.moe_forward(x, ids, weights, w2, None, w13, None)
    u8 = torch.uint8
    with pytest.raises(ValueError, match="multiple of 32"):
        kernel.PackedExperts.from_vllm(torch.zeros(1, 4, 8, dtype=u8), torch.zeros(1, 4, 0, dtype=u8))
    with pytest.raises(ValueError, match="scales"):
        kernel.PackedExperts.from_vllm(torch.zeros(1, 4, 16, dtype=u8), torch.zeros(1, 4, 2, dtype=u8))


def test_non_finite_scale_and_input_propagate(isa: str) -> None:
    """E8M0 byte 255 (NaN) and non-finite activations make the affected outputs non-finite."""
    ex = random_gpt_oss_mxfp4_experts(2, 64, 32, bias=False, seed=4)
    w13, w2 = pack(ex)
    x = random_hidden_states(2, 64, seed=5)
    ids = torch.tensor([[0], [1]], dtype=torch.int32)
    scales = ex.w2_weight_scale.clone()
    scales[1, 3, 0] = 255
    bad = kernel.PackedExperts.from_vllm(ex.w2_weight, scales)
    out = kernel.moe_forward(x, ids, torch.ones(2, 1), w13, None, bad, None, activation="silu")
    assert torch.isfinite(out[0]).all() and not torch.isfinite(out[1, 3])
    x[0, 5] = float("nan")
    out = kernel.moe_forward(x, ids, torch.ones(2, 1), w13, None, w2, None, activation="silu")
    assert not torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all()


def test_packed_experts_repack_is_same_size_and_reversible() -> None:
    """The load-time 16-row interleave keeps the byte count, leaves vLLM's tensors as they were, and inverts."""
    for rows in (96, 37, 8):  # whole 16-row groups; groups and a row-major tail; only a tail
        blocks, scales = random_mxfp4((4, rows, 160), seed=rows)
        before = blocks.clone(), scales.clone()
        packed = kernel.PackedExperts.from_vllm(blocks, scales)
        assert (packed.num_experts, packed.rows, packed.cols) == (4, rows, 160)
        assert packed.nbytes == blocks.numel() + scales.numel()
        assert packed.blocks.shape == blocks.shape and packed.scales.shape == scales.shape
        assert packed.blocks.is_contiguous() and packed.scales.is_contiguous()
        assert torch.equal(blocks, before[0]) and torch.equal(scales, before[1])
        assert rows < 16 or not torch.equal(packed.blocks, blocks)  # really reordered
        back = packed.to_vllm()
        assert torch.equal(back[0], blocks) and torch.equal(back[1], scales)
    strided = kernel.PackedExperts.from_vllm(blocks.transpose(0, 1).contiguous().transpose(0, 1), scales)
    assert strided.blocks.is_contiguous() and torch.equal(strided.to_vllm()[0], blocks)


def test_status_and_isa_env(monkeypatch: pytest.MonkeyPatch) -> None:
    ok, path = kernel.status()
    if not ok:
        pytest.skip(path) if path == "CPU lacks avx2+fma" else pytest.fail(path)
    monkeypatch.setenv(kernel.ISA_ENV, "avx2")
    assert kernel.status() == (True, "avx2") and kernel.isa() == "avx2"
    monkeypatch.setenv(kernel.ISA_ENV, "avx512")
    expected = "avx512" if AVX512_FLAGS <= cpu_flags() else "avx2"
    assert kernel.isa() == expected
    monkeypatch.delenv(kernel.ISA_ENV)
    assert kernel.isa() == expected


def _routed_f64(ex: object, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                rows: torch.Tensor) -> torch.Tensor:
    """:func:`moe_f64`'s math on output columns ``rows`` only, one routed expert decoded at a time (memory)."""
    out = torch.zeros(x.shape[0], rows.numel(), dtype=torch.float64)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w13 = dequantize_mxfp4_f64(ex.w13_weight[e], ex.w13_weight_scale[e])  # type: ignore[attr-defined]
        w2 = dequantize_mxfp4_f64(ex.w2_weight[e, rows], ex.w2_weight_scale[e, rows])  # type: ignore[attr-defined]
        h = x[tok].double() @ w13.T + ex.w13_bias[e].double()  # type: ignore[attr-defined]
        y = swiglu_oai(h) @ w2.T + ex.w2_bias[e, rows].double()  # type: ignore[attr-defined]
        out.index_add_(0, tok, y * weights[tok, slot].double().unsqueeze(1))
    return out


_CASES: dict[int, tuple[torch.Tensor, ...]] = {}


@pytest.fixture(scope="module")
def gpt_oss_20b_layer() -> object:
    return random_gpt_oss_mxfp4_experts(32, 2880, 2880, bias=True, seed=20)


def _case_20b(ex: object, tokens: int) -> tuple[torch.Tensor, ...]:
    """Inputs and the float64 answer on 256 output columns, computed once for both ISA paths."""
    if tokens not in _CASES:
        x = random_hidden_states(tokens, 2880, seed=tokens)
        g = torch.Generator().manual_seed(tokens)
        pool = torch.randperm(32, generator=g)[:6]  # 64 tokens over 6 experts: many tokens per expert
        ids = torch.stack([pool[torch.randperm(6, generator=g)[:4]] for _ in range(tokens)]).to(torch.int32)
        weights = torch.softmax(torch.randn(tokens, 4, generator=g), dim=-1)
        rows = torch.randperm(2880, generator=g)[:256]
        _CASES[tokens] = (x, ids, weights, rows, _routed_f64(ex, x, ids, weights, rows))
    return _CASES[tokens]


@pytest.mark.parametrize("tokens", [1, 64])
def test_gpt_oss_20b_layer_shape(isa: str, tokens: int, gpt_oss_20b_layer: object) -> None:
    """E=32, H=I=2880, top-4 (K = 2880 = 90 blocks: a partial last group on every row)."""
    ex = gpt_oss_20b_layer
    x, ids, weights, rows, ref = _case_20b(ex, tokens)
    w13, w2 = pack(ex)
    out = kernel.moe_forward(x, ids, weights, w13, ex.w13_bias, w2, ex.w2_bias)  # type: ignore[attr-defined]
    err = relative_error(out[:, rows], ref)
    assert err <= TOL, f"{isa}, T={tokens}: relative error {err:.4f} > {TOL}"


@pytest.mark.parametrize(("env", "read"), [("ISA_ENV", "isa"), ("PRECISION_ENV", "precision")])
def test_a_bad_setting_warns_once_not_at_every_forward(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture, env: str, read: str) -> None:
    """Both are read on every forward of every layer: one WARNING per process and value (issue 21, class 1)."""
    monkeypatch.setattr(kernel, "_warned", set())
    monkeypatch.setenv(getattr(kernel, env), "avx9\x1b[2J")
    with caplog.at_level("WARNING", logger="vllm.quantreg.cpu_mxfp4"):
        answers = {getattr(kernel, read)() for _ in range(50)}
    assert len(answers) == 1 and answers <= {"avx2", "avx512", *kernel.PRECISIONS}
    assert len(caplog.records) == 1 and "\x1b" not in caplog.records[0].getMessage()
    assert getattr(kernel, env) in caplog.records[0].getMessage()
