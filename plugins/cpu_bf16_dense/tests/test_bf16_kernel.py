"""The bf16 dense kernel (``quantreg_cpu_bf16_dense.kernel``) against float64, on both ISA paths.

The AVX2 path is forced with ``QUANTREG_CPU_BF16_DENSE_ISA=avx2`` (it runs on every x86-64 host);
the AVX-512 BF16 path runs where the CPU has it, else the test says so and skips.

The bound, derived (not fitted): nothing before the output is lossy -- the repack copies bits,
bf16 -> fp32 is exact, a product of two bf16 values is exact in fp32 (8 + 8 significant bits <= 24)
-- so the fp32 value before the last rounding is a sum of K exact products and the bias in some
order of fp32 additions. Any order of n = K + 1 terms is within ``gamma_{K} * (sum|w x| + |b|)`` of
the exact sum, ``gamma_j = j u / (1 - j u)``, u = 2^-24 (Higham, Accuracy and Stability of
Numerical Algorithms, 2nd ed., eq. 4.4). vdpbf16ps flushes denormals: at most 2^-126 more per step,
``(K + 1) * 2^-126`` in all. The output is then rounded to bf16 once: within half a bf16 ULP of
that fp32 value, which is within one ULP of the exact value's ULP (the half plus a possible change
of binade). So per output:

    |out - ref| <= ulp_bf16(|ref|) + gamma_K (sum_k |w_k x_k| + |b|) + (K + 1) 2^-126

which is what the faithful path (vLLM's bf16 layer, fp32 accumulation) meets too -- the tests hold
``torch.nn.functional.linear`` in bf16 to the same bound as a check of the bound itself. Beyond it,
both ISA paths add in the same order (``csrc/bf16_dense.h``), so they must give the same bits on
data without denormals.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
kernel = pytest.importorskip("quantreg_cpu_bf16_dense.kernel")

ISA_ENV = "QUANTREG_CPU_BF16_DENSE_ISA"
U = 2.0 ** -24
SHAPES = [(1, 64, 16), (1, 29, 37), (2, 100, 37), (3, 2880, 5120), (5, 2880, 17), (8, 4096, 48), (9, 36, 300),
          (64, 96, 130), (65, 72, 33), (130, 2880, 48)]

pytestmark = pytest.mark.skipif(not kernel.status()[0], reason=f"kernel not available: {kernel.status()[1]}")


def _set_isa(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    monkeypatch.setenv(ISA_ENV, isa)
    if isa == "avx512" and kernel.isa() != "avx512":
        pytest.skip("this CPU has no AVX-512 BF16: only the AVX2 path runs here")


def ulp_bf16(v: torch.Tensor) -> torch.Tensor:
    """One bf16 ULP at |v| (8 significant bits: 2^(e - 7)), at least the smallest normal's."""
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0 ** -126)))
    return torch.exp2(e - 7)


def bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the float64 reference, the per-output bound of the module docstring)."""
    xd, wd = x.double().reshape(-1, x.shape[-1]), w.double()
    k = xd.shape[-1]
    ref = xd @ wd.t()
    mass = xd.abs() @ wd.abs().t()
    if b is not None:
        ref, mass = ref + b.double(), mass + b.double().abs()
    gamma = k * U / (1 - k * U)
    return ref, ulp_bf16(ref) + gamma * mass + (k + 1) * 2.0 ** -126


def _data(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16)
    return x, w, b


def _within(out: torch.Tensor, ref: torch.Tensor, limit: torch.Tensor) -> None:
    err = (out.double().reshape(ref.shape) - ref).abs()
    worst = int(torch.argmax(err - limit))
    assert bool((err <= limit).all()), (f"output {worst}: error {err.flatten()[worst]:.3g} > bound "
                                        f"{limit.flatten()[worst]:.3g} (ref {ref.flatten()[worst]:.6g})")


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_within_one_bf16_ulp_plus_the_accumulation_slack(monkeypatch: pytest.MonkeyPatch, isa: str, m: int, k: int,
                                                         n: int) -> None:
    _set_isa(monkeypatch, isa)
    x, w, b = _data(m, k, n, m * 1000 + k + n)
    pw = kernel.PackedWeight.from_weight(w)
    for bias in (b, None):
        out = kernel.linear(x, pw, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        ref, limit = bound(x, w, bias)
        _within(out, ref, limit)


def test_the_bound_is_the_faithful_paths_own() -> None:
    """torch's bf16 linear (fp32 accumulation, what vLLM's own layer does) meets the same bound: the
    bound is bf16 rounding plus order, not a tolerance chosen for this kernel."""
    for m, k, n in SHAPES[:6]:
        x, w, b = _data(m, k, n, 7 + k)
        ref, limit = bound(x, w, b)
        _within(torch.nn.functional.linear(x, w, b), ref, limit)


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_the_two_isa_paths_give_the_same_bits(monkeypatch: pytest.MonkeyPatch, m: int, k: int, n: int) -> None:
    _set_isa(monkeypatch, "avx512")
    x, w, b = _data(m, k, n, 11 * m + k)
    pw = kernel.PackedWeight.from_weight(w)
    fast = kernel.linear(x, pw, b)
    monkeypatch.setenv(ISA_ENV, "avx2")
    slow = kernel.linear(x, pw, b)
    assert torch.equal(fast, slow)
    ref, limit = bound(x, w, b)  # and so both within the bound
    _within(fast, ref, limit)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_denormals_stay_within_the_bound(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    """Inputs with bf16 denormals and products that underflow: vdpbf16ps flushes them (DAZ / FTZ),
    the AVX2 FMA keeps them; both within the bound's (K + 1) 2^-126 term."""
    _set_isa(monkeypatch, isa)
    gen = torch.Generator().manual_seed(5)
    k, n = 96, 20
    w = (torch.randn(n, k, generator=gen) * 2.0 ** -120).to(torch.bfloat16)  # bf16 denormals below 2^-126
    x = (torch.randn(3, k, generator=gen) * 2.0 ** -10).to(torch.bfloat16)
    assert bool((w.float().abs() < 2.0 ** -126).any())
    out = kernel.linear(x, kernel.PackedWeight.from_weight(w))
    ref, limit = bound(x, w, None)
    _within(out, ref, limit)


def test_the_one_documented_difference_of_vdpbf16ps_is_denormal_flushing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A product that underflows (2^-70 x 2^-60 = 2^-130, below fp32's smallest normal): the AVX2
    FMA keeps it exactly, vdpbf16ps flushes it to zero (FTZ, Intel SDM) -- measured, not assumed."""
    w = torch.zeros(16, 8, dtype=torch.bfloat16)
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    w[0, 0], x[0, 0] = 2.0 ** -70, 2.0 ** -60
    pw = kernel.PackedWeight.from_weight(w)
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert kernel.linear(x, pw, None)[0, 0].item() == 2.0 ** -130
    _set_isa(monkeypatch, "avx512")
    assert kernel.linear(x, pw, None)[0, 0].item() == 0.0


def test_repack_is_exact_and_inputs_of_other_dtypes() -> None:
    x, w, b = _data(4, 100, 37, 3)
    pw = kernel.PackedWeight.from_weight(w)
    assert torch.equal(pw.unpack(), w.float())
    assert pw.nbytes == 48 * 104 * 2  # rows to 16, columns to 8
    ref, limit = bound(x, w, b)
    x3 = kernel.linear(x.reshape(2, 2, 100), pw, b)  # 3-D input
    assert x3.shape == (2, 2, 37)
    _within(x3.reshape(4, 37), ref, limit)
    out32 = kernel.linear(x.float(), pw, b.float())  # fp32 activations: the AVX2 tile, out fp32
    assert out32.dtype == torch.float32
    err = (out32.double() - ref).abs()
    assert bool((err <= limit - ulp_bf16(ref) + ref.abs() * 2 * U).all())
    out16 = kernel.linear(x.half(), pw, None)
    assert out16.dtype == torch.float16 and out16.shape == (4, 37)


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="expected a 2-D bf16 CPU weight"):
        kernel.PackedWeight.from_weight(torch.randn(4, 8))
    pw = kernel.PackedWeight.from_weight(torch.randn(4, 8).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"x must be a CPU tensor \[\.\.\., 8\]"):
        kernel.linear(torch.randn(2, 9).to(torch.bfloat16), pw)
    with pytest.raises(ValueError, match=r"bias has shape \(3,\), expected \(4,\)"):
        kernel.linear(torch.randn(2, 8).to(torch.bfloat16), pw, torch.randn(3))


def test_a_bad_isa_value_is_ignored_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(ISA_ENV, "sse9")
    with caplog.at_level("WARNING", logger="vllm.quantreg.cpu_bf16_dense"):
        assert kernel.isa() in ("avx2", "avx512")
        kernel.isa()
    assert [r.getMessage() for r in caplog.records].count(f"{ISA_ENV}='sse9' is not 'avx2' or 'avx512'; "
                                                            "ignoring it") <= 1


def test_the_op_is_one_opaque_call_under_torch_compile() -> None:
    """vLLM's default (compiled) mode traces the layer: the registered op with its fake gives
    ``fullgraph=True`` and the same bits as eager."""
    x, w, b = _data(1, 64, 40, 3)
    pw = kernel.PackedWeight.from_weight(w)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(kernel.linear(x, pw, b)) * 2

    compiled = torch.compile(layer, fullgraph=True, backend="inductor", dynamic=False)
    gen = torch.Generator().manual_seed(9)
    for m in (1, 5, 70):
        xm = torch.randn(m, 64, generator=gen).to(torch.bfloat16)
        assert torch.equal(compiled(xm), layer(xm))
    torch.library.opcheck(torch.ops.quantreg_cpu_bf16_dense.linear.default,
                          (torch.randn(3, 64).to(torch.bfloat16), pw.packed, b, 40, 64))
    assert math.isfinite(float(layer(x).float().sum()))
