"""What a verified MoE forward is compared with (``verify:`` inside vLLM, :mod:`.verify`).

* ``against: float64``: :class:`Float64Reference`, the format's float64 definition
  (:mod:`quantreg.models.gpt_oss_moe`) on the shadow's packed weights, decoding only the experts a
  call routes to;
* :func:`vllm_default_routing`: vLLM's plain top-k router, for a modular ``against`` method beside a
  chosen method that routes inside (both then see the same experts);
* :func:`synthetic_batch`: the load check's seeded tokens and router logits, the same in every process.

Imports torch; imported by :mod:`.verify` only once vLLM builds a verified layer.
"""

from __future__ import annotations

from typing import Any

import torch

from ..table.verify import FLOAT64

#: Tokens in the load check's synthetic batch (seeded, so every process checks the same batch).
LOAD_TOKENS = 8
LOAD_SEED = 20261201


def synthetic_batch(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded hidden states ``[LOAD_TOKENS, hidden]`` in the layer's activation dtype and router
    logits ``[LOAD_TOKENS, global experts]`` (float32), on the device of the layer's weights."""
    moe = layer.moe_config
    params = list(layer._parameters.values())
    device = params[0].device if params else torch.device("cpu")
    dtype = getattr(moe, "in_dtype", None) or torch.bfloat16
    generator = torch.Generator().manual_seed(LOAD_SEED)
    x = torch.randn(LOAD_TOKENS, int(moe.hidden_dim), generator=generator).to(dtype=dtype, device=device)
    logits = torch.randn(LOAD_TOKENS, int(moe.num_experts), generator=generator).to(device=device)
    return x, logits


def vllm_default_routing(layer: Any, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's plain top-k router (softmax, top-k, renormalise if the layer says so), for a modular
    ``against`` beside a chosen method that routes inside; other routers cannot be reproduced here."""
    if getattr(layer, "use_grouped_topk", False) or getattr(layer, "custom_routing_function", None) is not None \
            or getattr(layer, "scoring_func", "softmax") != "softmax":
        raise NotImplementedError("the layer's router (grouped, custom or non-softmax) is not reproducible "
                                  "outside vLLM's runner; verify against a method that routes inside")
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, int(layer.top_k), dim=-1)
    if getattr(layer, "renormalize", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Float64Reference:
    """``against: float64``: GPT-OSS MXFP4 experts evaluated in float64 from the packed weights."""

    name = FLOAT64

    def __init__(self) -> None:
        from ..models.gpt_oss import PARAMETERS

        self.PARAMETERS: tuple[str, ...] = PARAMETERS

    def check_layer(self, layer: Any) -> None:
        from ..models.gpt_oss import PARAMETERS

        activation = getattr(layer, "activation", None)
        name = getattr(activation, "value", activation)
        if name != "swigluoai":
            raise ValueError(f"the float64 reference computes SwiGLU-OAI, this layer's activation is {name}")
        for required in PARAMETERS[:4]:
            param = layer._parameters.get(required)
            if param is None or param.dtype != torch.uint8:
                raise ValueError(f"the float64 reference reads uint8 MXFP4 parameter '{required}', which the "
                                 f"chosen method did not create as such")

    def route(self, layer: Any, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from ..models.gpt_oss_moe import route_topk_softmax

        return route_topk_softmax(logits.reshape(-1, logits.shape[-1]), int(layer.top_k))

    def run(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The float64 MoE block (:func:`quantreg.models.gpt_oss_moe.moe_f64`), decoding routed experts only."""
        from ..formats.mxfp4 import dequantize_mxfp4_f64
        from ..models.gpt_oss import DEFAULT_ALPHA, DEFAULT_LIMIT
        from ..models.gpt_oss_moe import moe_f64_by_expert

        p = layer._parameters
        alpha = float(layer.swiglu_alpha) if getattr(layer, "swiglu_alpha", None) is not None else DEFAULT_ALPHA
        limit = float(layer.swiglu_limit) if getattr(layer, "swiglu_limit", None) is not None else DEFAULT_LIMIT
        xd = x.reshape(-1, x.shape[-1])
        ids = topk_ids.reshape(xd.shape[0], -1)
        num_local = int(p["w13_weight"].shape[0])

        def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (dequantize_mxfp4_f64(p["w13_weight"][e], p["w13_weight_scale"][e]),
                    dequantize_mxfp4_f64(p["w2_weight"][e], p["w2_weight_scale"][e]))

        return moe_f64_by_expert(xd, ids, topk_weights.reshape(ids.shape), num_local, expert, p.get("w13_bias"),
                                 p.get("w2_bias"), experts_min=int(layer.moe_config.ep_rank) * num_local,
                                 alpha=alpha, limit=limit)
