"""quantreg's seams hand vLLM methods that compile to one opaque op call (issue 43, :mod:`quantreg.vllm.opaque`).

The methods here do what breaks or corrupts a Dynamo trace: a file check (``os.stat``, what
plugin #2's library lookup did), a host read of a data-dependent count, a Python branch on the
token count (what a ``tokens:`` split is) and a counter (what ``verify:`` samples by). Compiled
the way vLLM's default mode compiles (fullgraph, the token dimension dynamic, one graph for every
batch size), each runs on every call with the right branch, and gives the eager output. The same
method not made opaque fails to compile: the test is not vacuous. Real vLLM runs of the same are in
tests/e2e/test_default_mode.py.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM is not installed in this environment")

from quantreg.vllm import opaque  # noqa: E402

SMALL = 4  # the branch bound: <= SMALL tokens one side, above it the other


class SideEffects:
    """A monolithic MoE method whose forward no tracer can follow, with a per-call counter."""

    is_monolithic = True

    def __init__(self) -> None:
        self.calls = 0
        self.sides: list[str] = []

    def apply_monolithic(self, layer: Any, x: Any, router_logits: Any, input_ids: Any = None, **_: Any) -> Any:
        os.stat(os.__file__)  # a file check, as a ctypes library lookup does
        self.calls += 1
        routed = int((router_logits.argmax(dim=-1) >= 0).sum().item())  # a host read of a data-dependent count
        side = "small" if x.shape[0] <= SMALL else "large"  # a token-count branch, as a split's bisect
        self.sides.append(side)
        scale = 2.0 if side == "small" else 3.0
        return (x * layer.weight * scale + routed * 0).to(x.dtype)


class Layer(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, width, dtype=torch.bfloat16), requires_grad=False)


def _compiled(method: Any, layer: Any) -> Any:
    torch._dynamo.reset()

    def forward(x: Any, logits: Any) -> Any:
        return method.apply_monolithic(layer=layer, x=x, router_logits=logits)

    return torch.compile(forward, fullgraph=True, dynamic=True, backend="aot_eager")


def test_a_method_with_side_effects_compiles_as_one_op_and_runs_every_call() -> None:
    layer, method = Layer(16), SideEffects()
    opaque.make_moe_opaque(method, layer, "model.layers.0.mlp.experts")
    fn = _compiled(method, layer)
    for tokens in (1, 512, 3, 64):
        x = torch.randn(tokens, 16, dtype=torch.bfloat16)
        logits = torch.randn(tokens, 8)
        out = fn(x.clone(), logits)
        scale = 2.0 if tokens <= SMALL else 3.0
        assert torch.equal(out, (x * layer.weight * scale).to(x.dtype)), tokens
    # every compiled call ran the method's Python, each with the side its own token count picks
    assert method.calls == 4
    assert method.sides == ["small", "large", "small", "large"]


def test_without_the_op_the_same_method_does_not_compile() -> None:
    layer, method = Layer(16), SideEffects()
    fn = _compiled(method, layer)
    with pytest.raises(Exception, match=r"skipped|data-dependent|Unsupported|guard"):
        fn(torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(2, 8))


def test_modular_methods_and_shared_experts() -> None:
    class Modular:
        is_monolithic = False

        def __init__(self) -> None:
            self.calls = 0

        def apply(self, layer: Any, x: Any, topk_weights: Any, topk_ids: Any, shared_experts: Any = None,
                  shared_experts_input: Any = None) -> Any:
            os.stat(os.__file__)
            self.calls += 1
            return x * topk_weights.sum(dim=-1, keepdim=True).to(x.dtype)

    layer, method = Layer(8), Modular()
    opaque.make_moe_opaque(method, layer, "model.layers.1.mlp.experts")
    torch._dynamo.reset()

    def forward(x: Any, w: Any, ids: Any) -> Any:
        return method.apply(layer=layer, x=x, topk_weights=w, topk_ids=ids)

    fn = torch.compile(forward, fullgraph=True, dynamic=True, backend="aot_eager")
    x, w, ids = torch.randn(5, 8), torch.rand(5, 2), torch.randint(0, 4, (5, 2))
    assert torch.equal(fn(x.clone(), w, ids), x * w.sum(dim=-1, keepdim=True))
    assert method.calls == 1
    # eager, with a shared-experts object (no op can carry it): the method itself, unchanged
    assert torch.equal(method.apply(layer=layer, x=x, topk_weights=w, topk_ids=ids, shared_experts=object()),
                       x * w.sum(dim=-1, keepdim=True))
    assert method.calls == 2


def test_a_method_answering_in_place_is_copied_out_of_the_op() -> None:
    class InPlace:
        is_monolithic = True

        def apply_monolithic(self, layer: Any, x: Any, router_logits: Any, input_ids: Any = None) -> Any:
            return x.mul_(2)

    layer, method = Layer(4), InPlace()
    opaque.make_moe_opaque(method, layer, "in.place")
    x = torch.ones(3, 4)
    out = opaque.MOE_MONOLITHIC(x, torch.zeros(3, 2), None, method.quantreg_handle)
    assert torch.equal(out, torch.full((3, 4), 2.0))
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_linear_methods_compile_with_the_layers_width() -> None:
    class Dense:
        def apply(self, layer: Any, x: Any, bias: Any = None) -> Any:
            os.stat(os.__file__)
            out = x @ layer.weight.t()
            return out if bias is None else out + bias

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(12, 6), requires_grad=False)
    layer.output_size_per_partition = 12
    method = Dense()
    opaque.make_linear_opaque(method, layer, "model.layers.0.self_attn.qkv_proj")
    torch._dynamo.reset()
    bias = torch.randn(12)

    def forward(x: Any) -> Any:
        return method.apply(layer, x, bias)

    fn = torch.compile(forward, fullgraph=True, dynamic=True, backend="aot_eager")
    for tokens in (1, 9):
        x = torch.randn(tokens, 6)
        assert torch.allclose(fn(x), x @ layer.weight.t() + bias)


def test_a_replicated_linear_router_compiles_with_its_output_size() -> None:
    """vLLM 0.32's ``ReplicatedLinear`` (GPT-OSS's router, ``GateLinear``) has ``output_size`` and no
    ``output_size_per_partition``: the fake takes its width from there (a dense rule on the router
    in vLLM's default mode failed without it, "the output width ... is unknown")."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    from quantreg.testing.dense import vllm_one_rank

    with vllm_one_rank():
        layer = GateLinear(6, 4, bias=False, params_dtype=torch.float32, prefix="model.layers.0.mlp.router",
                           return_bias=False)
    layer.weight.data.copy_(torch.randn(4, 6))
    assert not hasattr(layer, "output_size_per_partition") and layer.output_size == 4

    class Dense:  # the method stands in for a plugin's; the layer is vLLM's own router class
        def apply(self, layer: Any, x: Any, bias: Any = None) -> Any:
            return x @ layer.weight.t()

    method = Dense()
    opaque.make_linear_opaque(method, layer, "model.layers.0.mlp.router")
    torch._dynamo.reset()

    def forward(x: Any) -> Any:
        return method.apply(layer, x, None)

    fn = torch.compile(forward, fullgraph=True, dynamic=True, backend="aot_eager")
    x = torch.randn(3, 6)
    assert torch.allclose(fn(x), x @ layer.weight.t())


def test_handles_are_unique_and_name_the_layer() -> None:
    a, b = Layer(2), Layer(2)
    ma, mb = SideEffects(), SideEffects()
    opaque.make_moe_opaque(ma, a, "model.layers.7.mlp.experts")
    opaque.make_moe_opaque(mb, b, "model.layers.7.mlp.experts")  # a draft model's layer of the same name
    assert ma.quantreg_handle == "model.layers.7.mlp.experts"
    assert mb.quantreg_handle == "model.layers.7.mlp.experts#2"
    del a
    with pytest.raises(RuntimeError, match="no longer exists"):
        opaque.MOE_MONOLITHIC(torch.ones(1, 2), torch.ones(1, 2), None, ma.quantreg_handle)
    with pytest.raises(RuntimeError, match="no method registered for handle 'nowhere'"):
        opaque.MOE_MONOLITHIC(torch.ones(1, 2), torch.ones(1, 2), None, "nowhere")


def test_the_opaque_calls_key_vllms_compile_cache() -> None:
    """Two configs whose layers are routed differently hash differently (vLLM's compile cache key)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    hashes = []
    for kinds in ((True,), (True, True), (False,)):
        config = VllmConfig()
        before = config.compute_hash()
        with set_current_vllm_config(config):
            for i, monolithic in enumerate(kinds):
                method = SideEffects()
                method.is_monolithic = monolithic  # type: ignore[misc]
                opaque.make_moe_opaque(method, Layer(2), f"key.test.{i}")
        assert opaque.GRAPH_KEY in config.additional_config
        hashes.append(config.compute_hash())
        assert hashes[-1] != before
    assert len(set(hashes)) == 3


def test_on_the_cpu_vllm_traces_into_the_moe_runner_so_quantreg_needs_its_own_op() -> None:
    """Why quantreg registers ops at all: on CUDA and TPU vLLM 0.32 runs every MoE layer behind its own
    ``torch.ops.vllm.moe_forward`` (opaque to the compiler, method included); on the CPU its runner
    calls the Python function directly, so Dynamo traces into the quant method. Read from a real layer
    built by vLLM's factory (the kit's harness), on this CPU platform."""
    from vllm.model_executor.layers.fused_moe.runner import moe_runner

    from quantreg.testing.harness import VllmMoeHarness

    with VllmMoeHarness() as harness:
        layer = harness.build_routed(quant_config=None)  # an unquantized layer: vLLM's own method on any CPU
    entry = layer.runner._forward_entry
    assert entry is moe_runner._moe_forward, entry
    assert entry is not torch.ops.vllm.moe_forward


def test_a_layer_that_cannot_be_weakly_referenced_is_held() -> None:
    """A layer object without weak references (a slotted class, a test double) is held, not refused:
    the seam must never fail on what it cannot weakly reference."""

    class Slotted:
        __slots__ = ("weight",)

        def __init__(self) -> None:
            self.weight = torch.ones(2)

    layer, method = Slotted(), SideEffects()
    opaque.make_moe_opaque(method, layer, "slotted.layer")
    out = opaque.MOE_MONOLITHIC(torch.ones(1, 2), torch.zeros(1, 2), None, method.quantreg_handle)
    assert torch.equal(out, torch.full((1, 2), 2.0))
