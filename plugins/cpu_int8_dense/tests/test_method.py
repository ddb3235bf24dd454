"""The method on its own, on a plain module holding a bf16 weight: what it keeps resident after load
is what it reports (tools that count bytes read per token rely on ``resident_bytes()``, since the
int8 copy lives inside oneDNN's handler, not in a parameter), and its output stays near the bf16
product -- on a host with VNNI. Without VNNI oneDNN's int8 GEMM saturates (issue 46, class 3): there
the method is declared unable to run, and this test asserts that declaration instead."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")


def test_resident_bytes_is_the_int8_copy_and_its_scales() -> None:
    from quantreg.host import host_facts
    from quantreg.registry import Registry

    facts = host_facts()
    availability = Registry.build(config=[]).methods["cpu_int8_dense"].availability("cpu")
    if not (facts.has("avx512_vnni") or facts.has("avx_vnni")):
        assert not availability.ok and availability.reason.startswith(
            "needs cpu flag avx512_vnni or avx_vnni, this host has "), availability
        pytest.skip(f"no VNNI here, where the method is declared unable to run: {availability.reason}")
    assert availability.ok, availability
    from quantreg_cpu_int8_dense.method import CpuInt8DenseMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    n, k = 96, 64
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    method = CpuInt8DenseMethod(UnquantizedLinearMethod())
    method.process_weights_after_loading(layer)

    assert layer.weight is None  # the bf16 copy is released
    assert method.resident_bytes() == n * k + n * 4
    x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
    out = method.apply(layer, x)
    want = x.float() @ weight.float().t()
    assert out.shape == (3, n) and out.dtype == torch.bfloat16
    assert (out.float() - want).abs().max().item() < 0.05 * want.abs().max().item()
