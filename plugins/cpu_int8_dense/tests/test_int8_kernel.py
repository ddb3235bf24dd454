"""The int8 dense kernel (``quantreg_cpu_int8_dense.kernel``) against float64, on both ISA paths.

The AVX2 path is forced with ``QUANTREG_CPU_INT8_DENSE_ISA=avx2`` (it runs on every x86-64 host); the
AVX-512 VNNI path runs where the CPU has it, else the test says so and skips.

Error bound, and why: the kernel's block dot products are exact in int32, so what differs from
``x @ W.T`` in float64 is the two int8 roundings per 32-block along K (issue 54, llama.cpp's Q8_0
scheme) -- the weight's (error up to ``max|w_block| / 254`` per element, plus the fp16 rounding of its
scale, 2^-11) and the activations' (``max|x_block| / 254``) -- plus the output's rounding to its
dtype. For random Gaussian data at K = 36..4096 that is measured at 0.3-1.1 % of ``max|ref|``
(``max`` of a few thousand outputs: the per-token kernel measured 0.3-1.3 %); the tests hold it to
:data:`BOUND` = 1.5 %. (The rms error, where block scaling pays most on heavy-tailed activations, is
the kit's heavy-tailed check: ``test_heavy_tailed_kit.py``.) Beyond the bound, the kernel must equal
the same computation done in float64 on the quantised integers (``exact``) to fp32 accumulation
(:data:`ULP_FP32`): that is what "does not saturate" means, and an AVX2 path that
clipped int16 pair sums (as oneDNN's int8 GEMM does without VNNI) fails it by 10 % and more
(:func:`test_the_avx2_path_does_not_saturate_at_the_worst_case`).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
kernel = pytest.importorskip("quantreg_cpu_int8_dense.kernel")

BOUND = 0.015
ULP_FP32 = 1e-5
"""fp32 outputs against the same computation in float64: the kernel accumulates Kp / 32 block terms in
fp32 (one rounding per FMA, up to 128 blocks at K = 4096: ~128 x 2^-24 = 7.6e-6 of the largest partial
sum in the worst case), where the per-token kernel had one product."""
ISA_ENV = "QUANTREG_CPU_INT8_DENSE_ISA"
SHAPES = [(1, 64, 16), (3, 100, 37), (1, 2880, 5120), (13, 2880, 17), (9, 36, 300), (8, 4096, 48), (33, 96, 130)]

pytestmark = pytest.mark.skipif(not kernel.status()[0], reason=f"kernel not available: {kernel.status()[1]}")


def _isas() -> list[str]:
    return ["avx2", "avx512"]


def _set_isa(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    monkeypatch.setenv(ISA_ENV, isa)
    if isa == "avx512" and kernel.isa() != "avx512":
        pytest.skip("this CPU has no AVX-512 VNNI: only the AVX2 path runs here")


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """``[rows, K]`` -> ``[rows, ceil(K / 32), 32]``, zero padded."""
    k = t.shape[-1]
    kp = (k + 31) // 32 * 32
    return torch.nn.functional.pad(t, (0, kp - k)).reshape(t.shape[0], kp // 32, 32)


def _exact(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's computation in float64: int8 activations per (token, 32-block) rounded as the kernel
    rounds them (fp32 ``x * (127 / amax)``, half to even), exact integer block dots, the same scales."""
    xb = _blocks(x.float().reshape(-1, x.shape[-1]))
    amax = xb.abs().amax(dim=2)
    # a tensor / tensor division: torch computes ``127.0 / amax`` as ``127 * reciprocal(amax)``, which
    # differs from the kernel's ``127.0f / amax`` in the last bit and moves half-way codes by a step
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv[:, :, None]).clamp(-127, 127).double()
    dots = torch.einsum("mbk,nbk->mnb", xq, _blocks(q.double()))
    out = (dots * (scale.double()[None, :, :] * (amax / 127.0).double()[:, None, :])).sum(dim=2)
    if bias is not None:
        out = out + bias.double()
    return out


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_kernel_matches_float64_within_the_bound(monkeypatch: pytest.MonkeyPatch, isa: str, m: int, k: int, n: int,
                                                 dtype: torch.dtype) -> None:
    _set_isa(monkeypatch, isa)
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if n % 2 else None
    q, scale = kernel.quantize_blocks(w)
    pw = kernel.PackedWeight.from_int8(q, scale)
    out = kernel.linear(x, pw, bias)
    assert out.shape == (m, n) and out.dtype == dtype
    ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert 0 < err <= BOUND, err
    exact = _exact(x, q, scale, bias)
    ulp = {torch.float32: ULP_FP32, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    assert float((out.double() - exact).abs().max() / exact.abs().max()) <= ulp


@pytest.mark.parametrize(("m", "k", "n"), SHAPES[:4])
def test_both_paths_give_the_same_bits(monkeypatch: pytest.MonkeyPatch, m: int, k: int, n: int) -> None:
    """Integer dots are exact on both paths: the outputs are identical, not only close."""
    gen = torch.Generator().manual_seed(7)
    pw = kernel.PackedWeight.from_weight(torch.randn(n, k, generator=gen))
    x = torch.randn(2, m, k, generator=gen).to(torch.bfloat16)  # a leading batch dimension too
    outs = {}
    for isa in _isas():
        _set_isa(monkeypatch, isa)
        outs[isa] = kernel.linear(x, pw)
    assert outs["avx2"].shape == (2, m, n)
    assert torch.equal(outs["avx2"], outs["avx512"])


@pytest.mark.parametrize("isa", _isas())
def test_the_avx2_path_does_not_saturate_at_the_worst_case(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    """Every weight and activation at +-127, signs aligned so that every product is +16,129 and every
    int16 pair sum 32,258 (the most any pair can reach): the result must be exact. A u8 x s8 scheme
    with activations offset to 0..255 would clip these pairs at 32,767."""
    _set_isa(monkeypatch, isa)
    k, n = 2048, 48
    signs = torch.where(torch.arange(k) % 3 == 0, -1.0, 1.0)
    w = signs.repeat(n, 1) * (127 / 128)  # every row +-127/128 -> q = +-127 with scale 2^-7 (exact in fp16)
    w[1::2] *= -1           # odd rows: every product -16,129
    x = signs[None, :].clone()
    pw = kernel.PackedWeight.from_weight(w)
    out = kernel.linear(x, pw)
    want = torch.where(torch.arange(n) % 2 == 0, float(k), float(-k)) * (127 / 128)
    assert torch.allclose(out[0], want, rtol=1e-6, atol=0), out[0, :4]


@pytest.mark.parametrize("isa", _isas())
def test_non_finite_activations_make_their_token_nan(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    _set_isa(monkeypatch, isa)
    pw = kernel.PackedWeight.from_weight(torch.randn(20, 32))
    x = torch.randn(3, 32)
    x[1, 5] = float("inf")
    x[2] = 0.0
    out = kernel.linear(x, pw)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all() and torch.equal(out[2], torch.zeros(20))


def test_bad_inputs_are_refused_in_words() -> None:
    with pytest.raises(ValueError, match=r"is -128; the kernel needs \[-127, 127\]"):
        kernel.PackedWeight.from_int8(torch.full((4, 8), -128, dtype=torch.int8), torch.ones(4, 1))
    with pytest.raises(ValueError, match="the kernel takes 1 <= K <= 65536"):
        kernel.PackedWeight.from_int8(torch.zeros((4, 65537), dtype=torch.int8), torch.ones(4, 2049))
    with pytest.raises(ValueError, match=r"expected \(4, 2\): one per 32-block"):
        kernel.PackedWeight.from_int8(torch.zeros((4, 40), dtype=torch.int8), torch.ones(4))
    with pytest.raises(ValueError, match="weight row 2: a 32-block's scale"):
        kernel.PackedWeight.from_weight(torch.tensor([[1.0] * 8, [2.0] * 8, [1e7] + [0.0] * 7]))
    pw = kernel.PackedWeight.from_weight(torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"x must be a CPU tensor \[\.\.\., 16\]"):
        kernel.linear(torch.randn(2, 15), pw)
    with pytest.raises(ValueError, match=r"bias has shape \(7,\), expected \(8,\)"):
        kernel.linear(torch.randn(2, 16), pw, torch.randn(7))


def test_a_bad_isa_setting_warns_once_and_is_ignored(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(ISA_ENV, "sse9")
    with caplog.at_level("WARNING", logger="vllm.quantreg.cpu_int8_dense"):
        first, second = kernel.isa(), kernel.isa()
    assert first == second in ("avx2", "avx512")
    assert [r.getMessage() for r in caplog.records].count(f"{ISA_ENV}='sse9' is not 'avx2' or 'avx512'; "
                                                          "ignoring it") <= 1


def test_the_op_is_one_opaque_call_under_torch_compile() -> None:
    """vLLM's default (compiled) mode traces the layer: the registered op with its fake gives
    ``fullgraph=True`` and the same output as eager (issue 43)."""
    gen = torch.Generator().manual_seed(3)
    pw = kernel.PackedWeight.from_weight(torch.randn(40, 64, generator=gen))
    bias = torch.randn(40, generator=gen).to(torch.bfloat16)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(kernel.linear(x, pw, bias)) * 2

    compiled = torch.compile(layer, fullgraph=True, backend="inductor", dynamic=False)
    for m in (1, 5):
        x = torch.randn(m, 64, generator=gen).to(torch.bfloat16)
        assert torch.equal(compiled(x), layer(x))
    torch.library.opcheck(torch.ops.quantreg_cpu_int8_dense.linear.default,
                          (torch.randn(3, 64).to(torch.bfloat16), pw.packed, pw.scale, bias, 40, 64))
