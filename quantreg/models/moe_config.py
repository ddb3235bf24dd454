"""Which decoder layers have routed experts, and how many, read from a model's ``config.json``.

Why here (model-config knowledge, torch-free): ``quantreg plan`` reads it from a checkpoint
directory and the vLLM start-up (:mod:`quantreg.vllm.startup`) reads it from vLLM's config to
say how many layers a decision covers; both ask this one module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..bounds import MAX_LAYERS as BOUND_LAYERS

#: Config keys for the number of routed experts, in the order models use them.
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_top_k")
INTERMEDIATE_KEYS = ("moe_intermediate_size", "intermediate_size")
MAX_LAYERS = BOUND_LAYERS
"""More decoder layers than any model has (:data:`quantreg.bounds.MAX_LAYERS`); a larger count in config.json is
refused, never iterated."""


def first_of(config: Mapping[str, Any], keys: Sequence[str]) -> Any:
    """The value of the first of ``keys`` that ``config`` sets (not ``None``), else ``None``."""
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    return None


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of ``config`` (multimodal configs nest it in ``text_config``)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def moe_layer_indices(config: Mapping[str, Any]) -> list[int]:
    """Which decoder layers have routed experts, following each model family's config fields.

    * DeepSeek V2/V3/V4, Kimi: ``first_k_dense_replace`` dense layers first, then every
      ``moe_layer_freq``-th layer (``i >= k and i % freq == 0``);
    * Qwen2/3-MoE: ``mlp_only_layers`` are dense, others MoE when ``(i + 1) % decoder_sparse_step == 0``;
    * Llama 4: ``interleave_moe_layer_step`` (``moe_layers`` when given explicitly);
    * everything else with experts (GPT-OSS, Mixtral, ...): every layer.
    """
    cfg = text_config(config)
    layers = cfg.get("num_hidden_layers")
    n = layers if type(layers) is int and 0 <= layers <= MAX_LAYERS else 0  # 10^12 layers: refused, never iterated
    if not first_of(cfg, EXPERT_COUNT_KEYS):
        return []
    if isinstance(cfg.get("moe_layers"), list):
        return sorted(int(i) for i in cfg["moe_layers"] if 0 <= int(i) < n)
    if "first_k_dense_replace" in cfg or "moe_layer_freq" in cfg:
        k = int(cfg.get("first_k_dense_replace") or 0)
        freq = max(1, int(cfg.get("moe_layer_freq") or 1))
        return [i for i in range(n) if i >= k and i % freq == 0]
    if "decoder_sparse_step" in cfg or "mlp_only_layers" in cfg:
        step = max(1, int(cfg.get("decoder_sparse_step") or 1))
        dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
        return [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    if "interleave_moe_layer_step" in cfg:
        step = max(1, int(cfg.get("interleave_moe_layer_step") or 1))
        return list(range(step - 1, n, step))
    return list(range(n))
