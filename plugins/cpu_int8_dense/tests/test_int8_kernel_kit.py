"""``quantreg check-method cpu_int8_dense_kernel``: the kit's dense suite (real vLLM layers: attention,
dense, lm_head at its small shape, 1 / 7 / 64 tokens, against float64 with the kit's 0.02 tolerance)
passes on both ISA paths -- AVX-512 VNNI where the CPU has it, and AVX2 forced by
``QUANTREG_CPU_INT8_DENSE_ISA=avx2`` -- and on a host quantreg believes AVX2-only
(``quantreg.host.simulate("avx2")``: the method declares ``cpu:avx2, cpu:fma`` only, so it stays
available there, unlike ``cpu_int8_dense``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from quantreg.host import simulate

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("setting", ["default", "avx2-forced", "avx2-host"])
def test_the_kit_passes_on_each_isa_path(setting: str, check_method: Callable[..., Any]) -> None:
    env = {} if setting == "default" else {"QUANTREG_CPU_INT8_DENSE_ISA": "avx2"}
    if setting == "avx2-host":
        env.update(simulate("avx2"))
    _, lines = check_method("cpu_int8_dense_kernel", env)
    assert lines[1].startswith("device cpu: available (kernel built: libquantreg_cpu_int8_dense.so, ISA path "), lines
    if setting != "default":
        assert "ISA path avx2 (AVX2 sign trick, forced by QUANTREG_CPU_INT8_DENSE_ISA)" in lines[1], lines[1]
    for layer in ("attention", "dense", "lm_head"):
        row = next(line for line in lines if f"forward_{layer}" in line)
        assert row.split()[0] == "PASS", row
    row = next(line for line in lines if "heavy-tailed" in line)
    assert row.split()[0] == "PASS", row  # as fine as llama.cpp's Q8_0 on massive activation channels
    assert any(line.startswith("numerics weights int8 per (output row, 32-block along K)") for line in lines[:4]), lines
    assert "cpu_int8_dense_kernel on cpu: conforms -- 7 passed, 0 failed, 0 skipped" in lines
