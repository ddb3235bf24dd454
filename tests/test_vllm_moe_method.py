"""``quantreg.vllm.moe_method``: vLLM's GPT-OSS MXFP4 weights without its backend (issue 24, duplicates D2).

Both plugins once carried their own copy of this constructor. On these CPUs vLLM's own
``GptOssMxfp4MoEMethod`` constructor selects a backend (and refuses without AMX); a subclass
initialised by :func:`init_without_backend` must build on any host, keep vLLM's ``create_weights``
(the parameters vLLM's GPT-OSS loader writes, checked by loading real experts through the real
weight loaders), and find vLLM's class even after a platform plugin rebinds the module attribute.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch", reason="building vLLM layers needs torch")
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (the helpers subclass its MXFP4 method)", allow_module_level=True)

import torch

from quantreg.models.gpt_oss_moe import random_gpt_oss_mxfp4_experts
from quantreg.testing.harness import VllmMoeHarness, method_factory
from quantreg.vllm.moe_method import init_without_backend, upstream_mxfp4_method


class WeightsOnly(upstream_mxfp4_method()):  # type: ignore[misc]
    """A method with vLLM's MXFP4 parameters and nothing that runs (what a plugin starts from)."""

    def __init__(self, moe: Any) -> None:
        init_without_backend(self, moe)


@pytest.fixture(scope="module")
def harness() -> Iterator[VllmMoeHarness]:
    with VllmMoeHarness() as h:
        yield h


def test_upstream_class_is_vllms_even_when_rebound(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.layers.quantization import mxfp4

    original = mxfp4.GptOssMxfp4MoEMethod
    assert upstream_mxfp4_method() is original
    platform_subclass = type("PlatformMxfp4MoEMethod", (original,), {"__module__": "some_platform.ops"})
    monkeypatch.setattr(mxfp4, "GptOssMxfp4MoEMethod", platform_subclass)  # what vllm-gaudi does
    assert upstream_mxfp4_method() is original


def test_builds_without_a_backend_and_keeps_vllms_weights(harness: VllmMoeHarness) -> None:
    experts = random_gpt_oss_mxfp4_experts(8, 64, 96, bias=True, seed=11)
    layer = harness.build(method_factory(WeightsOnly), top_k=2, bias=True)
    method = layer.method
    assert isinstance(method, WeightsOnly) and method.mxfp4_backend is None and method.moe_kernel is None
    params = layer.parameters()
    assert {"w13_weight", "w13_weight_scale", "w13_bias", "w2_weight", "w2_weight_scale", "w2_bias"} <= set(params)
    assert params["w13_weight"].dtype == torch.uint8 and params["w13_bias"].dtype == torch.bfloat16
    padded = params["w13_weight"].shape[1] // 2
    assert padded % 64 == 0 and padded >= 96  # no backend: vLLM pads the intermediate size to a multiple of 64
    layer.load(experts)  # vLLM's own weight loaders write into create_weights' parameters
    loaded = layer.parameters()
    blocks = experts.tensors()["w13_weight"].reshape(8, 2 * 96, -1)
    assert torch.equal(loaded["w13_weight"][:, :2 * 96], blocks)
    assert torch.count_nonzero(loaded["w13_weight"][:, 2 * 96:]) == 0  # the padding stays zero
    assert torch.equal(loaded["w2_bias"], experts.tensors()["w2_bias"])
