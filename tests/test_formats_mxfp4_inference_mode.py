"""``dequantize_mxfp4`` under ``torch.inference_mode``: the threaded path for big tensors (issue 19).

The decode shares chunks out to Python threads; inference mode is per thread, so before the fix
the pool's threads wrote into the caller's inference tensor outside inference mode and raised
("Inplace update to inference tensor outside InferenceMode"). The conformance kit runs forwards
under inference mode, so no method that dequantises could be checked at real shapes.
"""

from __future__ import annotations

import pytest
import torch

from quantreg.formats.mxfp4 import dequantize_mxfp4, dequantize_mxfp4_f64, random_mxfp4


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "plain"])
def test_threaded_decode_works_in_every_grad_mode(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTREG_MXFP4_COMPILE", "0")  # the pure-torch threaded path under test
    blocks, scales = random_mxfp4((2, 1024, 2048), seed=3)  # 65,536 rows of 32: several threads' share
    want = dequantize_mxfp4_f64(blocks, scales).to(torch.bfloat16)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if mode == "inference_mode":
            with torch.inference_mode():
                got = dequantize_mxfp4(blocks, scales)
            assert got.is_inference()
        elif mode == "no_grad":
            with torch.no_grad():
                got = dequantize_mxfp4(blocks, scales)
        else:
            got = dequantize_mxfp4(blocks, scales)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(got, want)
