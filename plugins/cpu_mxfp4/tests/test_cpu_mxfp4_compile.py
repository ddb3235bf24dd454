"""``cpu_mxfp4`` under ``torch.compile`` (issue 43): what vLLM's default mode does to a method.

vLLM-CPU without ``--enforce-eager`` traces the model with Dynamo (``fullgraph``) and compiles it
with inductor. Dynamo steps into the method's ``apply_monolithic`` / ``apply``; the kernel (ctypes,
the cached library load, settings read from the environment, the prefill callback) must be one
opaque custom op there. Real vLLM layers built, loaded and processed by the kit's harness.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("quantreg_cpu_mxfp4", reason="quantreg-cpu-mxfp4 is not installed in this venv")

from quantreg_cpu_mxfp4 import kernel
from quantreg_cpu_mxfp4.method import CpuMxfp4MoEMethod

from quantreg.models.gpt_oss_moe import (
    random_gpt_oss_mxfp4_experts,
    random_hidden_states,
    random_router_logits,
    relative_error,
)

pytestmark = pytest.mark.vllm

EXPERTS, HIDDEN, INTER, TOP_K = 8, 64, 96, 2
# 1: decode; 64: a small prefill (16 tokens per expert: the int8 GEMV); 512: 128 per expert, past
# GEMM_MIN_TOKENS, so the prefill path's torch.mm callback runs inside the compiled graph too.
TOKENS = (1, 64, 512)
OP = torch.ops.quantreg_cpu_mxfp4.moe_forward


@pytest.fixture(scope="module")
def layer() -> Iterator[Any]:
    from quantreg.testing.harness import VllmMoeHarness, method_factory

    experts = random_gpt_oss_mxfp4_experts(EXPERTS, HIDDEN, INTER, bias=True, seed=5)
    with VllmMoeHarness() as harness:
        ready = harness.ready(method_factory(CpuMxfp4MoEMethod), experts, top_k=TOP_K)
        ready.reference = experts
        with harness.context():
            yield ready


def _monolithic(layer: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    method, experts = layer.method, layer.experts

    def call(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = method.apply_monolithic(experts, x, logits)
        return out

    return call


def _modular(layer: Any) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    method, experts = layer.method, layer.experts

    def call(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = method.apply(experts, x, weights, ids)
        return out

    return call


def test_dynamo_records_the_kernel_as_one_opaque_op(layer: Any) -> None:
    """fullgraph: no graph break anywhere in the method; the kernel is exactly one node of the graph."""
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, _inputs: list[torch.Tensor]) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(_monolithic(layer), backend=record, fullgraph=True)
    x = random_hidden_states(64, HIDDEN, seed=1)
    with torch.no_grad():
        compiled(x, random_router_logits(64, EXPERTS, seed=2))
    assert len(graphs) == 1
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function"]
    kernel_calls = [n for n in calls if n.target in (OP, OP.default)]
    assert len(kernel_calls) == 1, [str(n.target) for n in calls]
    # nothing else of the kernel leaks into the graph: every other node is routing or reshaping
    assert not [n for n in calls if n not in kernel_calls and "quantreg" in str(n.target)]


@pytest.mark.parametrize("isa", ["default", "avx2"])
def test_compiled_monolithic_forward_equals_eager(layer: Any, isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """inductor, token count dynamic: 1, 64 and 512 tokens give the eager outputs (and stay near float64).

    The ISA setting is read inside the op at every call, so forcing AVX2 after compiling still applies.
    """
    if isa == "avx2":
        monkeypatch.setenv("QUANTREG_CPU_MXFP4_ISA", "avx2")
        assert kernel.isa() == "avx2"
    torch._dynamo.reset()
    eager = _monolithic(layer)
    compiled = torch.compile(eager, fullgraph=True, dynamic=True)
    for tokens in TOKENS:
        x = random_hidden_states(tokens, HIDDEN, seed=tokens)
        logits = random_router_logits(tokens, EXPERTS, seed=tokens + 1)
        with torch.no_grad():
            want = eager(x, logits)
            got = compiled(x, logits)
        assert got.shape == want.shape == x.shape and got.dtype == want.dtype == torch.bfloat16
        # same experts and (up to inductor's softmax rounding) the same weights: equal to bf16 rounding
        assert relative_error(got, want.double()) <= 1e-2, tokens
        ids = torch.topk(logits, TOP_K, dim=-1).indices
        weights = torch.softmax(torch.topk(logits.double(), TOP_K, dim=-1).values, dim=-1)
        ref = layer.reference.reference(x, ids, weights)
        assert relative_error(got, ref) <= 1e-2, tokens


def test_compiled_modular_forward_equals_eager(layer: Any) -> None:
    """``apply`` (vLLM's router chose the experts) compiles to the same outputs as eager."""
    torch._dynamo.reset()
    eager = _modular(layer)
    compiled = torch.compile(eager, fullgraph=True, dynamic=True)
    for tokens in (1, 64):
        x = random_hidden_states(tokens, HIDDEN, seed=tokens + 7)
        logits = random_router_logits(tokens, EXPERTS, seed=tokens + 8)
        values, ids = torch.topk(logits, TOP_K, dim=-1)
        weights = torch.softmax(values, dim=-1)
        with torch.no_grad():
            want = eager(x, weights, ids.to(torch.int32))
            got = compiled(x, weights, ids.to(torch.int32))
        assert torch.equal(got, want), tokens
