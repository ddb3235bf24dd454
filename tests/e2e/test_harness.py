"""The harness itself, against vLLM alone (quantreg's start-up hook kept out via VLLM_PLUGINS).

What vLLM 0.32 does with a GPT-OSS MXFP4 checkpoint on CPU depends on the machine: its only
CPU MXFP4 MoE kernel (``CPUExpertsMxfp4``) needs AMX. So:

* with AMX, vLLM alone must load the tiny MXFP4 model, build ``GptOssMxfp4MoEMethod`` for every
  MoE layer (checked inside the worker) and generate finite, non-tied, deterministic output;
* without AMX, vLLM alone must fail to start with its "no MXFP4 MoE backend" error: that is the
  gap quantreg exists to fill, and if a future vLLM closes it this test says so.

Both branches on any host (``host_kind``, tests/core_support.py): on an AMX host the "without" run
hides AMX from vLLM's check in the child (``quantreg.testing.host_kind.without_amx_env``); on a
host without AMX the "with" branch skips, naming the hardware it needs.

The bf16 twin checkpoint (same weights, experts dequantised exactly) runs everywhere, so the
harness (generation, logprobs, worker-side inspection, the MoE probe, both process layouts) is
always exercised. MoE outputs are checked against an fp32 oracle computed from the checkpoint
tensors (:func:`quantreg.models.gpt_oss_moe.reference_moe_block`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from core_support import HOST_KINDS, HostKind
from e2e_support import VllmRuns

from quantreg.models.gpt_oss import tiny_gpt_oss_config
from quantreg.models.gpt_oss_moe import reference_moe_block
from quantreg.testing.vllm_run import (
    DEMO_PROMPTS,
    VLLM_MXFP4_METHOD,
    VLLM_NO_MXFP4_BACKEND,
    VLLM_ONLY_ENV,
    VLLM_UNQUANTIZED_METHOD,
    RunResult,
)
from quantreg.tiny.checkpoint import load_tensors

VOCAB = int(tiny_gpt_oss_config()["vocab_size"])
LAYERS = int(tiny_gpt_oss_config()["num_hidden_layers"])
MAX_TOKENS = 4
PROBE_TOKENS = 8

#: the session fixture from conftest.py (a ``VllmRuns``): ``vllm_run(model_dir, **run_vllm_kwargs)``
#: -> RunResult, memoised; ``vllm_run.start(...)`` launches without waiting


def _options(multiprocessing: bool, env: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "env": VLLM_ONLY_ENV if env is None else env,
        "multiprocessing": multiprocessing,
        "max_tokens": MAX_TOKENS,
        "probe_tokens": PROBE_TOKENS,
    }


def _run(vllm_run: VllmRuns, model: Path, *, multiprocessing: bool, env: dict[str, str] | None = None) -> RunResult:
    result: RunResult = vllm_run(model, **_options(multiprocessing, env))
    return result


@pytest.fixture(scope="module")
def _start_runs(vllm_run: VllmRuns, tiny_model: Path, tiny_model_bf16: Path, mxfp4_kernel_available: bool) -> None:
    """Launch every vLLM run this module needs up front so they overlap (see conftest).

    Used by the vLLM tests only, so ``-k checkpoint`` starts no vLLM at all.
    """
    vllm_run.start(tiny_model, **_options(False))
    if mxfp4_kernel_available:
        vllm_run.start(tiny_model, **_options(True))
    vllm_run.start(tiny_model_bf16, **_options(True))  # the longest: start it early
    vllm_run.start(tiny_model_bf16, **_options(False))


def assert_generated_sanely(result: RunResult) -> None:
    """Valid ids, the right count, finite and not-all-tied logprobs, one worker seen."""
    assert result.ok, f"vLLM run failed: {result.error}\n--- log tail ---\n{result.log[-6000:]}"
    assert len(result.token_ids) == len(DEMO_PROMPTS)
    for ids, chosen, tops in zip(result.token_ids, result.logprobs, result.top_logprobs):
        assert len(ids) == MAX_TOKENS
        assert all(0 <= t < VOCAB for t in ids), ids
        assert len(chosen) == MAX_TOKENS and all(math.isfinite(lp) and lp <= 0.0 for lp in chosen), chosen
        for token, step in zip(ids, tops):
            assert all(math.isfinite(v) for v in step.values()), step
            # greedy: the chosen token is the most likely one
            assert step[token] == max(step.values())
            # a random model whose logits were all (nearly) tied would make greedy decoding a
            # coin toss decided by rounding; the checkpoint's magnitudes are chosen to avoid it
            assert max(step.values()) - min(step.values()) > 0.1, step
    assert len(result.worker_moe_layers) == 1  # TP=1: one worker


def assert_moe_layers(result: RunResult, method: str) -> None:
    """Every MoE layer, as seen inside the worker, runs ``method``."""
    methods = result.moe_quant_methods
    assert sorted(methods) == [f"model.layers.{i}.mlp.experts.routed_experts" for i in range(LAYERS)]
    assert set(methods.values()) == {method}, methods


def assert_probe_sane(result: RunResult) -> dict[str, torch.Tensor]:
    outputs = result.load_moe_outputs()
    assert sorted(outputs) == ["input"] + [f"model.layers.{i}.mlp" for i in range(LAYERS)]
    hidden = int(tiny_gpt_oss_config()["hidden_size"])
    for name, tensor in outputs.items():
        assert tensor.shape == (PROBE_TOKENS, hidden), (name, tensor.shape)
        assert torch.isfinite(tensor).all(), name
        assert tensor.abs().max() > 0.01, name  # the experts contributed something
    return outputs


def assert_matches_reference(result: RunResult, model: Path, rel: float = 2e-2) -> None:
    """MoE probe outputs against the fp32 oracle computed from the checkpoint's own tensors.

    ``rel`` is relative to the largest output: vLLM hands back bf16, whose spacing at ~8 is
    0.0625, so 2e-2 allows about two bf16 ULPs (measured: <= 1 ULP, ~1e-2 at worst).
    """
    outputs = assert_probe_sane(result)
    tensors = load_tensors(model)
    for layer in range(LAYERS):
        expected = reference_moe_block(tensors, layer, outputs["input"])
        got = outputs[f"model.layers.{layer}.mlp"]
        worst = float((got - expected).abs().max())
        assert worst <= rel * float(expected.abs().max()), (layer, worst, float(expected.abs().max()))


def assert_same_run(a: RunResult, b: RunResult) -> None:
    """Same tokens; logprobs and MoE outputs equal up to float noise."""
    assert a.token_ids == b.token_ids
    for la, lb in zip(a.logprobs, b.logprobs):
        assert la == pytest.approx(lb, abs=1e-3)
    pa, pb = a.load_moe_outputs(), b.load_moe_outputs()
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], rtol=1e-3, atol=1e-3, msg=name)


# ---------------------------------------------------------------------------------------------
# The checkpoint itself (no vLLM run)
# ---------------------------------------------------------------------------------------------


def test_checkpoint_has_the_real_gpt_oss_layout(tiny_model: Path, tiny_model_bf16: Path) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["model_type"] == "gpt_oss"
    assert config["architectures"] == ["GptOssForCausalLM"]
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert "quantization_config" not in json.loads((tiny_model_bf16 / "config.json").read_text())
    e, h, i = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    tensors = load_tensors(tiny_model)
    x = "model.layers.0.mlp.experts."
    expected = {
        x + "gate_up_proj_blocks": ((e, 2 * i, h // 32, 16), torch.uint8),
        x + "gate_up_proj_scales": ((e, 2 * i, h // 32), torch.uint8),
        x + "gate_up_proj_bias": ((e, 2 * i), torch.bfloat16),
        x + "down_proj_blocks": ((e, h, i // 32, 16), torch.uint8),
        x + "down_proj_scales": ((e, h, i // 32), torch.uint8),
        x + "down_proj_bias": ((e, h), torch.bfloat16),
        "model.layers.0.self_attn.sinks": ((config["num_attention_heads"],), torch.bfloat16),
        "model.layers.0.mlp.router.weight": ((e, h), torch.bfloat16),
        "model.embed_tokens.weight": ((VOCAB, h), torch.bfloat16),
        "lm_head.weight": ((VOCAB, h), torch.bfloat16),
    }
    for name, (shape, dtype) in expected.items():
        assert tuple(tensors[name].shape) == shape and tensors[name].dtype == dtype, name
    scales = tensors[x + "gate_up_proj_scales"].int() - 127
    assert -8 <= int(scales.min()) and int(scales.max()) <= 0  # E8M0 scales near 2**-5, no inf/NaN bytes
    twin = load_tensors(tiny_model_bf16)
    assert tuple(twin[x + "gate_up_proj"].shape) == (e, h, 2 * i)
    assert tuple(twin[x + "down_proj"].shape) == (e, i, h)
    # the twin is the exact dequantisation: same oracle output from either layout
    probe = torch.randn(3, h, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(
        reference_moe_block(tensors, 1, probe), reference_moe_block(twin, 1, probe), rtol=1e-5, atol=1e-5
    )


# ---------------------------------------------------------------------------------------------
# vLLM alone on the MXFP4 checkpoint
# ---------------------------------------------------------------------------------------------


@pytest.mark.compat
@pytest.mark.usefixtures("_start_runs")
@pytest.mark.parametrize("kind", HOST_KINDS)
def test_vllm_alone_mxfp4_single_process(vllm_run: VllmRuns, tiny_model: Path, host_kind: HostKind, kind: str) -> None:
    """vLLM alone on the MXFP4 model, as a host of ``kind`` sees it: runs its own kernel (AMX) or refuses."""
    result = _run(vllm_run, tiny_model, multiprocessing=False, env=host_kind.vllm_env(kind, VLLM_ONLY_ENV))
    if host_kind.kernel_runs(kind):
        assert_generated_sanely(result)
        assert_moe_layers(result, VLLM_MXFP4_METHOD)
        assert result.worker_pids == [result.runner_pid]  # engine and worker live in the runner
        assert_probe_sane(result)
    else:
        # No AMX: vLLM 0.32 has no MXFP4 MoE backend for this CPU and refuses to start.
        assert not result.ok
        assert result.returncode != 0
        assert VLLM_NO_MXFP4_BACKEND in result.log, result.log[-6000:]
        assert "kernel does not support current device cpu" in result.log  # the CPU kernel's own reason
        assert "GptOssMxfp4MoEMethod" in result.log  # the method vLLM was constructing when it gave up


@pytest.mark.usefixtures("_start_runs")
def test_vllm_alone_mxfp4_multiprocessing(vllm_run: VllmRuns, tiny_model: Path, host_kind: HostKind) -> None:
    """With AMX, the same in a worker process (without AMX the refusal is pinned by the single-process
    test, and multiprocessing is covered by the bf16 twin)."""
    host_kind.vllm_env("amx")
    result = _run(vllm_run, tiny_model, multiprocessing=True)
    assert_generated_sanely(result)
    assert_moe_layers(result, VLLM_MXFP4_METHOD)
    assert result.runner_pid not in result.worker_pids  # the methods were read in the worker process
    assert_probe_sane(result)


@pytest.mark.usefixtures("_start_runs")
def test_vllm_alone_mxfp4_same_seed_same_tokens(vllm_run: VllmRuns, tiny_model: Path, host_kind: HostKind) -> None:
    """With AMX, vLLM's own kernel is deterministic across process layouts (see the bf16 twin's test)."""
    host_kind.vllm_env("amx")
    assert_same_run(
        _run(vllm_run, tiny_model, multiprocessing=False),
        _run(vllm_run, tiny_model, multiprocessing=True),
    )


@pytest.mark.usefixtures("_start_runs")
def test_vllm_mxfp4_kernel_matches_reference(vllm_run: VllmRuns, tiny_model: Path, host_kind: HostKind) -> None:
    """vLLM's own CPU MXFP4 kernel against the fp32 oracle on the same weights (needs real AMX)."""
    host_kind.vllm_env("amx")
    assert_matches_reference(_run(vllm_run, tiny_model, multiprocessing=False), tiny_model)


# ---------------------------------------------------------------------------------------------
# The bf16 twin: runs on every CPU, so the harness is always exercised end to end
# ---------------------------------------------------------------------------------------------


@pytest.mark.compat
@pytest.mark.usefixtures("_start_runs")
def test_bf16_twin_single_process(vllm_run: VllmRuns, tiny_model_bf16: Path) -> None:
    result = _run(vllm_run, tiny_model_bf16, multiprocessing=False)
    assert_generated_sanely(result)
    assert_moe_layers(result, VLLM_UNQUANTIZED_METHOD)
    assert result.worker_pids == [result.runner_pid]
    assert "Resolved architecture: GptOssForCausalLM" in result.log  # the log is captured
    # vLLM's unquantized MoE on the twin computes what the format says (interleaved gate/up,
    # clamped SwiGLU-OAI, biases, top-k routing): the twin is a faithful stand-in for MXFP4.
    assert_matches_reference(result, tiny_model_bf16)


@pytest.mark.compat
@pytest.mark.usefixtures("_start_runs")
def test_bf16_twin_multiprocessing_same_seed_same_tokens(vllm_run: VllmRuns, tiny_model_bf16: Path) -> None:
    """Default multiprocessing (engine + worker processes) against the 1-process run: two
    independent runs with the same seed must agree, and the worker is a different process."""
    mp = _run(vllm_run, tiny_model_bf16, multiprocessing=True)
    assert_generated_sanely(mp)
    assert_moe_layers(mp, VLLM_UNQUANTIZED_METHOD)
    assert mp.runner_pid not in mp.worker_pids
    assert_same_run(_run(vllm_run, tiny_model_bf16, multiprocessing=False), mp)
