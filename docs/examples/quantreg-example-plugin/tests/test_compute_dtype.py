"""A plugin's own test on real vLLM layers, with the kit's fixtures and float64 reference."""

from quantreg_example_plugin.method import ExampleMxfp4MoEMethod

from quantreg.models.gpt_oss_moe import (
    random_hidden_states,
    random_router_logits,
    relative_error,
    route_topk_softmax,
)
from quantreg.testing.harness import method_factory


def test_float32_compute_is_closer_to_the_reference(moe_harness, gpt_oss_mxfp4_experts):
    experts = gpt_oss_mxfp4_experts(bias=True, seed=1)
    x = random_hidden_states(16, experts.hidden, seed=2)
    logits = random_router_logits(16, experts.num_experts, seed=3)
    weights, ids = route_topk_softmax(logits, 2)
    reference = experts.reference(x, ids, weights)  # float64, from the format's definition
    errors = {}
    for dtype in ("bfloat16", "float32"):
        factory = method_factory(ExampleMxfp4MoEMethod, {"compute_dtype": dtype})  # as the seam builds it
        layer = moe_harness.ready(factory, experts, top_k=2)  # create_weights, vLLM's loader, post-processing
        errors[dtype] = relative_error(layer.forward(x, logits), reference)
    assert errors["float32"] <= errors["bfloat16"] < 1e-2, errors
