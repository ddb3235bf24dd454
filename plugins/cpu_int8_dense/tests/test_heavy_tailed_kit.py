"""The kit's heavy-tailed-activation check (issue 54) on dense methods, in real vLLM layers.

* ``cpu_int8_dense_kernel`` (block-scaled, Q8_0's scheme) passes it on both ISA paths: its rms error
  against float64 stays within 1.10x a Q8_0 emulation's on Gaussian inputs and with massive channels;
* a deliberately per-token variant (``kit_pertoken.py``, test-only) fails it, and the failure names the
  method, the input case, the token count and both errors;
* vLLM's oneDNN ``cpu_int8_dense`` (per-token activations) fails it too where it runs (VNNI hosts):
  why no shipped table offers it.
"""

from __future__ import annotations

import re

import pytest

from quantreg import Method
from quantreg.testing import run_checks
from quantreg.testing.report import Status

pytestmark = pytest.mark.vllm
ONLY = {"registered", "heavy-tailed"}


def _row(report: object) -> tuple[Status, str]:
    result = report.result("heavy-tailed")  # type: ignore[attr-defined]
    return result.status, result.detail


@pytest.mark.parametrize("isa", ["default", "avx2"])
def test_the_block_scaled_kernel_is_as_fine_as_q8_0(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    if isa == "avx2":
        monkeypatch.setenv("QUANTREG_CPU_INT8_DENSE_ISA", "avx2")
    status, detail = _row(run_checks("cpu_int8_dense_kernel", device="cpu"))
    assert status is Status.PASS, detail
    worst = float(re.search(r"worst x([0-9.]+)", detail).group(1))  # type: ignore[union-attr]
    assert worst <= 1.10, detail


def test_a_per_token_variant_fails_located() -> None:
    method = Method(name="pertoken_int8_test_variant", target="kit_pertoken:PerTokenInt8DenseMethod",
                    devices=("cpu",), layers=("attention",))
    report = run_checks(method, device="cpu")
    status, detail = _row(report)
    assert status is Status.FAIL, detail
    assert "'pertoken_int8_test_variant' on attention 2880->512" in detail, detail
    assert "2 channels at 100x on 1 token in 4, 16 token(s): rms error" in detail, detail
    assert "x the Q8_0 emulation's" in detail, detail
    ratios = [float(r) for r in re.findall(r"\(x([0-9.]+)\)", detail)]
    assert max(ratios) > 3.0, detail  # the 100x case: several times Q8_0's error
    assert report.result("forward_attention").status is Status.PASS  # the old relative check let it through


def test_vllms_per_token_onednn_gemm_fails_it_where_it_runs() -> None:
    report = run_checks("cpu_int8_dense", device="cpu")
    if not report.available:
        pytest.skip(f"cpu_int8_dense cannot run here: {report.availability}")
    status, detail = _row(report)
    assert status is Status.FAIL and "'cpu_int8_dense' on attention" in detail, detail
