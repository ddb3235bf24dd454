"""GPT-OSS's constants and ``config.json``: the model facts every other module imports, torch-free.

Why torch-free: the plugin's option defaults (``quantreg_hpu_mxfp4.options``) are read while
listing plugins, where importing torch is not allowed; the math built on these constants is
:mod:`quantreg.models.gpt_oss_moe`.
"""

from __future__ import annotations

from typing import Any, TypedDict

DEFAULT_ALPHA = 1.702
"""SwiGLU-OAI's sigmoid slope in GPT-OSS."""
DEFAULT_LIMIT = 7.0
"""GPT-OSS's ``swiglu_limit``."""
HEAD_DIM = 64
"""GPT-OSS's attention head size; vLLM's attention and the yarn rope assume it for real checkpoints."""

#: Parameter names vLLM's GPT-OSS MXFP4 loader writes, in the order it meets them.
PARAMETERS: tuple[str, ...] = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale", "w13_bias", "w2_bias")


#: GPT-OSS's own vocabulary size. vLLM renders a GPT-OSS chat request with openai-harmony (the
#: o200k_harmony encoding: ``<|start|>`` 200006, ``<|message|>`` 200008, ...) whatever the model's
#: tokenizer or chat template says, and refuses a prompt id >= the model's vocabulary ("Token id
#: 200008 is out of vocabulary"); a tiny model that chats therefore needs this many rows.
CHAT_VOCAB = 201088


class TinySizes(TypedDict, total=False):
    """The size arguments of :func:`tiny_gpt_oss_config`, for callers that pass them through."""

    hidden: int
    intermediate: int
    layers: int
    experts: int
    top_k: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    sliding_window: int


#: openai/gpt-oss-20b's published sizes (its config.json), as :func:`tiny_gpt_oss_config` arguments:
#: a checkpoint written with them has the real tensor shapes (the rope/yarn settings, the sliding
#: window, the sliding/full ``layer_types`` alternation and the quantization config are the real
#: ones for every shape). ``layers`` may be overridden for quick runs.
GPT_OSS_20B: TinySizes = {"hidden": 2880, "intermediate": 2880, "layers": 24, "experts": 32, "top_k": 4,
                          "vocab": CHAT_VOCAB, "heads": 64, "kv_heads": 8, "head_dim": HEAD_DIM,
                          "sliding_window": 128}

#: Named shapes for ``quantreg tiny-model --shape``: ``tiny`` is the demo's few-MB model with the chat
#: vocabulary (:data:`CHAT_VOCAB`), ``20b`` GPT-OSS-20B at real size (~13 GB at 24 layers).
SHAPES: dict[str, TinySizes] = {"tiny": {"vocab": CHAT_VOCAB}, "20b": GPT_OSS_20B}


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
    head_dim: int = HEAD_DIM,
    sliding_window: int = 128,
    mxfp4: bool = True,
) -> dict[str, Any]:
    """The ``config.json`` dict: the real gpt-oss-20b config with the sizes shrunk.

    Kept field-for-field with the published config (including the legacy ``rope_scaling`` +
    ``rope_theta`` pair, which transformers 5 folds into ``rope_parameters``) so that vLLM
    walks the same config path it walks for the real model. The defaults are the demo
    checkpoint's (:mod:`quantreg.tiny.checkpoint`); the layer harness and the plugin tests shrink
    them further (no weights are written for those, so ``head_dim`` may be smaller too).
    ``mxfp4=False`` leaves out ``quantization_config``: a bf16 model, or a config whose
    quantization the caller sets up itself.
    """
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if not 0 < top_k <= experts:
        raise ValueError(f"need 0 < top_k ({top_k}) <= experts ({experts})")
    if vocab < 8:
        raise ValueError("vocab must leave room for the special token ids")
    config: dict[str, Any] = {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": vocab - 1,
        "experts_per_token": top_k,
        "head_dim": head_dim,
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
        "swiglu_limit": DEFAULT_LIMIT,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": vocab,
    }
    if not mxfp4:
        del config["quantization_config"]
    return config
