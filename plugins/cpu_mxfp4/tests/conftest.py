"""Fixtures of the plugin's tests: ``isa``, every kernel test once per ISA path it can take here."""

from __future__ import annotations

import pytest
from cpu_mxfp4_kernel_support import AVX512_FLAGS, cpu_flags


def _isa_params() -> list[object]:
    flags = cpu_flags()
    missing = sorted(AVX512_FLAGS - flags)
    return [
        pytest.param("avx2", id="avx2"),
        pytest.param("avx512", id="avx512", marks=pytest.mark.skipif(
            bool(missing), reason=f"this CPU lacks {', '.join(missing)}: the AVX-512 path cannot run here")),
    ]


@pytest.fixture(params=_isa_params())
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    from quantreg_cpu_mxfp4 import kernel  # here, not above: conftest.py loads without torch

    ok, why = kernel.status()
    if not ok and why == "CPU lacks avx2+fma":
        pytest.skip(why)
    assert ok, f"the compiled kernel must be available for these tests: {why}"
    monkeypatch.setenv(kernel.ISA_ENV, request.param)
    assert kernel.isa() == request.param
    return str(request.param)
