"""The second routing family on real vLLM layers: a custom routing function goes through vLLM's router.

``test_hpu_mxfp4_vllm.py`` covers GPT-OSS's monolithic routing and grouped top-k; this covers a
layer built with ``custom_routing_function`` (what e.g. Llama-4 style models pass): with
``routing: auto`` the method turns modular and the experts are exactly those the custom function
picks, with its weights (not a softmax of the logits).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
from quantreg_hpu_mxfp4 import method as methods
from quantreg_hpu_mxfp4 import reference
from test_hpu_mxfp4_vllm import EXPERTS, HIDDEN, TOP_K, build_runner, forward, layer_lists

pytestmark = pytest.mark.vllm

SEEN: list[tuple[int, int]] = []


def last_experts_sigmoid(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
                         renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A deliberately unusual router: the top-k of the *reversed* logits, sigmoid weights."""
    SEEN.append(tuple(gating_output.shape))  # type: ignore[arg-type]
    values, ids = torch.topk(-gating_output, topk, dim=-1)
    return torch.sigmoid(-values).to(torch.float32), ids.to(torch.int32)


def test_custom_routing_function_layer_uses_vllms_router(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config import VllmConfig

    config = VllmConfig()  # no model: 'auto' routing follows the layer
    runner = build_runner(monkeypatch, config, methods.Mxfp4ReferenceMoEMethod, {"routing": "auto"}, bias=False,
                          activation="silu", custom_routing_function=last_experts_sigmoid)
    method: Any = runner.routed_experts.quant_method
    assert not method.is_monolithic
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, HIDDEN, generator=g).to(torch.bfloat16)
    logits = torch.randn(5, EXPERTS, generator=g)
    SEEN.clear()
    out = forward(runner, config, x, logits)
    assert SEEN and SEEN[0] == (5, EXPERTS)  # vLLM's router called the custom function
    weights, ids = last_experts_sigmoid(x, logits, TOP_K, False)
    p = layer_lists(runner.routed_experts)
    want = reference.mxfp4_fused_weights(
        x, ids, weights.to(torch.bfloat16), p["w12"], p["w3"], p["d13"], p["d2"], block_size=32,
        permuted_weights=True, activation="silu", experts_min=0, experts_max=EXPERTS - 1)
    assert torch.equal(out, want)
    softmax_ids = torch.topk(logits, TOP_K, dim=-1).indices
    assert not torch.equal(ids.long().sort(-1).values, softmax_ids.sort(-1).values)  # really a different family
