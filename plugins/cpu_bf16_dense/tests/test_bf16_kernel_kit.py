"""``quantreg check-method cpu_bf16_dense_kernel``: the kit's dense suite (real vLLM layers: attention,
dense, lm_head at its small shape, 1 / 7 / 64 tokens, against float64 with the kit's tolerance, and
``torch.compile`` against eager) passes on both ISA paths -- AVX-512 BF16 where the CPU has it, and
AVX2 forced by ``QUANTREG_CPU_BF16_DENSE_ISA=avx2`` -- and on a host quantreg believes AVX2-only
(``quantreg.host.simulate("avx2")``: the method declares ``cpu:avx2, cpu:fma`` only)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from quantreg.host import simulate

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("setting", ["default", "avx2-forced", "avx2-host"])
def test_the_kit_passes_on_each_isa_path(setting: str, check_method: Callable[..., Any]) -> None:
    env = {} if setting == "default" else {"QUANTREG_CPU_BF16_DENSE_ISA": "avx2"}
    if setting == "avx2-host":
        env.update(simulate("avx2"))
    _, lines = check_method("cpu_bf16_dense_kernel", env)
    assert lines[1].startswith("device cpu: available (kernel built: libquantreg_cpu_bf16_dense.so, ISA path "), lines
    if setting != "default":
        assert "ISA path avx2 (AVX2+FMA, forced by QUANTREG_CPU_BF16_DENSE_ISA)" in lines[1], lines[1]
    for check in ("forward_attention", "forward_dense", "forward_lm_head", "heavy-tailed"):
        row = next(line for line in lines if check in line)
        assert row.split()[0] == "PASS", row
    # the dense suite's 7 checks: registered, available, 3 layer kinds' forwards, heavy-tailed (issue 54), compiled
    assert "cpu_bf16_dense_kernel on cpu: conforms -- 7 passed, 0 failed, 0 skipped" in lines
