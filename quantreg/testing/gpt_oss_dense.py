"""GPT-OSS's dense layers as vLLM builds them (one rank), for ``quantreg tune --layers`` (issue 30).

Why these classes and not the kit's ``ReplicatedLinear``: a method is timed where it will run. vLLM's
GPT-OSS model (``vllm/model_executor/models/gpt_oss.py``) builds, per decoder layer, a
``QKVParallelLinear`` (``attn.qkv_proj``) and a ``RowParallelLinear`` (``attn.o_proj``), both with
bias, the router as a ``GateLinear`` (``mlp.router``, with bias), and once a ``ParallelLMHead``;
the same classes are built here with the same prefixes, at the checkpoint's sizes, their weights
written through the parameters' own ``weight_loader`` (q, k and v into the fused QKV weight, as
vLLM's loader does). A linear layer runs its ``forward`` (the call vLLM's model makes); the
lm_head runs ``quant_method.apply(lm_head, hidden_states)``, the call vLLM's ``LogitsProcessor``
makes. A method is put in ``layer.quant_method`` after vLLM built the layer with its own method
(``UnquantizedLinearMethod`` / ``UnquantizedEmbeddingMethod``), as the kit's dense suite does: the
dense methods of a bf16 checkpoint keep vLLM's ``create_weights`` and convert in
``process_weights_after_loading``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

PARTS: Mapping[str, tuple[str, ...]] = {"attention": ("qkv_proj", "o_proj"), "dense": ("router",),
                                        "lm_head": ("lm_head",)}
"""The layers of each kind in one GPT-OSS decoder layer (the lm_head: once per model)."""
PREFIXES = {"qkv_proj": "model.layers.0.attn.qkv_proj", "o_proj": "model.layers.0.attn.o_proj",
            "router": "model.layers.0.mlp.router", "lm_head": "lm_head"}


@dataclass(frozen=True)
class DenseShape:
    """The sizes GPT-OSS's dense layers take from config.json."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int

    def in_out(self, part: str) -> tuple[int, int]:
        """(K, N): the input and output width of ``part``."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"qkv_proj": (self.hidden, q + 2 * kv), "o_proj": (q, self.hidden),
                "router": (self.hidden, self.experts), "lm_head": (self.hidden, self.vocab)}[part]


def build(part: str, shape: DenseShape) -> Any:
    """vLLM's layer for ``part`` at ``shape``: bf16 parameters, vLLM's own method (inside ``vllm_one_rank``)."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    dtype, prefix = torch.bfloat16, PREFIXES[part]
    if part == "qkv_proj":
        return QKVParallelLinear(hidden_size=shape.hidden, head_size=shape.head_dim, total_num_heads=shape.heads,
                                 total_num_kv_heads=shape.kv_heads, bias=True, params_dtype=dtype, prefix=prefix)
    if part == "o_proj":
        return RowParallelLinear(input_size=shape.heads * shape.head_dim, output_size=shape.hidden, bias=True,
                                 params_dtype=dtype, prefix=prefix)
    if part == "router":
        return GateLinear(shape.hidden, shape.experts, bias=True, params_dtype=dtype, prefix=prefix,
                          return_bias=False)
    if part == "lm_head":
        return ParallelLMHead(shape.vocab, shape.hidden, params_dtype=dtype, prefix=prefix)
    raise ValueError(f"unknown GPT-OSS dense part {part!r}; expected one of {', '.join(PREFIXES)}")


def load(layer: Any, part: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``tensors`` (the checkpoint's names without the layer prefix: ``q_proj.weight``, ...,
    ``weight``, ``bias``) into ``layer`` through its parameters' ``weight_loader``, as vLLM loads them."""
    params = dict(layer.named_parameters())
    if part == "qkv_proj":
        for what in ("weight", "bias"):
            param = params[what]
            for shard in ("q", "k", "v"):
                param.weight_loader(param, tensors[f"{shard}_proj.{what}"], shard)
        return
    for what in ("weight", "bias"):
        if what in params and what in tensors:
            param = params[what]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensors[what])
            else:
                loader(param, tensors[what])


def forward(layer: Any, part: str, x: torch.Tensor) -> Any:
    """The call vLLM makes: the linear layer's ``forward`` (output only), the lm_head's ``quant_method.apply``."""
    if part == "lm_head":
        return layer.quant_method.apply(layer, x, bias=None)
    out = layer(x)
    return out[0] if isinstance(out, tuple) else out
