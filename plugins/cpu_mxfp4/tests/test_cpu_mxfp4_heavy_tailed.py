"""The kit's heavy-tailed-activation check (issue 54) on ``cpu_mxfp4`` with each precision an opt-in
table chooses (``q8``: q8.yaml; ``q8x2``: the default rules): on inputs with a few channels at 10x and
100x the rest, the MoE output's rms error against float64 stays within 1.10x that of a Q8_0 emulation
of the same layer (exact MXFP4 weights, activations int8 per 32 with fp16 scales before w13 and w2, as
llama.cpp's ``vec_dot_mxfp4_q8_0``), at 1, 16 and 160 tokens (160 routes every expert past q8x2's
GEMM threshold, so its prefill path is checked too), on both ISA paths.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm")
pytest.importorskip("quantreg_cpu_mxfp4")

from quantreg.testing import run_checks
from quantreg.testing.report import Status

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("isa", ["default", "avx2"])
def test_both_precisions_are_as_fine_as_q8_0(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if isa == "avx2":
        monkeypatch.setenv("QUANTREG_CPU_MXFP4_ISA", "avx2")
    report = run_checks("cpu_mxfp4", device="cpu", only={"registered", "subclass", "heavy-tailed"},
                        option_sets=[{"precision": "q8"}, {"precision": "q8x2"}])
    result = report.result("heavy-tailed")
    assert result.status is Status.PASS, result.detail
    for precision in ("q8", "q8x2"):
        assert f"options {{'precision': '{precision}'}}" in result.detail, result.detail
    worst = [float(w) for w in re.findall(r"worst x([0-9.]+)", result.detail)]
    assert worst and max(worst) <= 1.10, result.detail
