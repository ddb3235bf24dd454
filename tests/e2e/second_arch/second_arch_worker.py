"""(Imported inside vLLM's worker.) Run every Mixtral MoE block of the loaded model on seeded inputs.

``test_second_arch`` names :func:`probe` in ``run_vllm(worker_checks=...)``; the worker imports
this module by name (it is on the worker's ``PYTHONPATH``) and calls it on the model vLLM built.

Why not the kit's ``probe_moe_layers``: it needs the ``VllmConfig`` on ``model.vllm_config``,
which vLLM's GPT-OSS model carries and its Mixtral model does not (and vLLM freezes the GC after
start-up, so the config cannot be found by search). The forward still goes through vLLM's own
runner (``MoERunner.forward`` -> ``moe_forward`` op -> the method), in a forward context naming
just that runner.

Besides the block's output, it records what the method handed its MoE op (``topk_ids``,
``topk_weights``): the experts the quantreg method actually chose, not a recomputation.
"""

from __future__ import annotations

from typing import Any

import torch

TOKENS = 16
SEED = 7


def _forward_context_for(runner: Any) -> Any:
    """A forward context in which vLLM's ``moe_forward`` op finds ``runner`` (and nothing else).

    vLLM's op looks the runner up by name in ``no_compile_layers`` (or, with
    ``fast_moe_cold_start``, as the next of ``all_moe_layers``); the MoE path reads no
    attention metadata. Built directly because the worker's ``VllmConfig`` is not reachable
    from a Mixtral model (GPT-OSS keeps it on ``model.vllm_config``).
    """
    from vllm.forward_context import ForwardContext, override_forward_context

    name = str(runner.layer_name)
    return override_forward_context(ForwardContext(no_compile_layers={name: runner}, attn_metadata={},
                                                   slot_mapping={}, all_moe_layers=[name]))


def probe(model: torch.nn.Module) -> dict[str, Any]:
    """Per MoE block: input, router logits, output and the op's routing table, as lists."""
    from quantreg.models.gpt_oss_moe import random_hidden_states, random_router_logits

    found: dict[str, Any] = {}
    for name, block in model.named_modules():
        runner: Any = getattr(block, "experts", None)
        experts = getattr(runner, "routed_experts", None)
        if experts is None or not hasattr(block, "gate"):
            continue
        method = experts.quant_method
        x = random_hidden_states(TOKENS, int(block.hidden_size), seed=SEED)
        logits = random_router_logits(TOKENS, int(experts.global_num_experts), seed=SEED + 1)
        seen: dict[str, torch.Tensor] = {}
        op = experts.moe_op

        def recording(x_: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *args: Any,
                      _op: Any = op, _seen: dict[str, torch.Tensor] = seen, **kwargs: Any) -> torch.Tensor:
            _seen["ids"], _seen["weights"] = ids.clone(), weights.clone()
            out: torch.Tensor = _op(x_, ids, weights, *args, **kwargs)
            return out

        experts.moe_op = recording
        try:
            with torch.inference_mode(), _forward_context_for(runner):
                out = runner(x.clone(), logits.clone())
        finally:
            experts.moe_op = op
        found[name] = {
            "method": f"{type(method).__module__}:{type(method).__qualname__}",
            "order": method._order, "model_type": method.model_type, "activation": method._activation,
            "w13_shape": list(experts.w13_weight.shape), "w2_shape": list(experts.w2_weight.shape),
            "input": x.float().tolist(), "router_logits": logits.float().tolist(),
            "output": out.float().tolist(), "topk_ids": seen["ids"].tolist(),
            "topk_weights": seen["weights"].float().tolist(),
        }
    return found
