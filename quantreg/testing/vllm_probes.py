"""What the runner looks at inside vLLM's worker processes (each function runs *there*).

Why a module of their own: vLLM's ``LLM.apply_model`` pickles the function it ships to every worker
by reference (module and name), so these must be module-level functions of a module the worker can
import under its real name; the parent side (:mod:`quantreg.testing.vllm_run`) never runs them, and
the child (:mod:`quantreg.testing.vllm_child`) only hands them over. Other in-worker checks
(``run_vllm(worker_checks=...)``, plugin #1's ``multirank.expert_slices``, ``bench/vllm_child.py``)
reuse :func:`moe_layers`, :func:`qualname` and :func:`inspect_moe_layers`.

Split out of ``vllm_run.py`` (issue 24: one idea per module); torch and vLLM are imported inside
the functions, so importing this module costs neither.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def qualname(obj: object) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}:{cls.__qualname__}"


def moe_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """MoE expert containers: modules whose ``quant_method`` is a fused-MoE method.

    Matching on the method base class (not on module names) keeps this working across vLLM's
    MoE refactors (``FusedMoE`` -> ``MoERunner`` + ``RoutedExperts``) and for other models.
    """
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import (  # type: ignore[import-not-found,unused-ignore]
        FusedMoEMethodBase,
    )

    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(getattr(module, "quant_method", None), FusedMoEMethodBase)
    ]


def inspect_moe_layers(model: torch.nn.Module) -> dict[str, Any]:
    """(Runs in the worker.) Quant method / kernel class of every MoE layer, plus the pid."""
    layers = []
    for name, module in moe_layers(model):
        method = module.quant_method
        experts_cls = getattr(method, "experts_cls", None)
        backend = getattr(method, "mxfp4_backend", None) or getattr(method, "unquantized_backend", None)
        layers.append(
            {
                "name": name,
                "quant_method": qualname(method),
                "experts_cls": qualname(experts_cls) if experts_cls is not None else None,
                "backend": getattr(backend, "name", None) if backend is not None else None,
            }
        )
    return {"pid": os.getpid(), "layers": layers}


def _moe_block_for(model: torch.nn.Module, expert_name: str) -> tuple[str, torch.nn.Module]:
    """The block that owns router + experts (``...mlp`` for gpt_oss), so the probe exercises
    routing too: the nearest ancestor with a ``router``/``gate`` *submodule* that is not the
    MoE runner itself (which also carries a ``router`` object but wants router logits)."""
    modules = dict(model.named_modules())
    parts = expert_name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:cut])
        module = modules.get(candidate)
        if module is None or hasattr(module, "routed_experts"):
            continue
        children = dict(module.named_children())
        if "router" in children or "gate" in children:
            return candidate, module
    raise LookupError(f"no router-owning ancestor for MoE layer {expert_name}")


def probe_moe_layers(model: torch.nn.Module, *, tokens: int, seed: int) -> dict[str, list[list[float]]]:
    """(Runs in the worker.) Feed every MoE block the same seeded input; return float lists.

    The input is ``randn(tokens, hidden)`` in bf16, i.e. roughly what a post-attention RMSNorm
    hands the MLP. Lists (not tensors) keep the trip back through vLLM's RPC format-agnostic.
    """
    import torch
    from vllm.config import get_current_vllm_config_or_none  # type: ignore[import-not-found,unused-ignore]
    from vllm.forward_context import set_forward_context  # type: ignore[import-not-found,unused-ignore]

    vllm_config = getattr(model, "vllm_config", None) or get_current_vllm_config_or_none()
    if vllm_config is None:
        raise RuntimeError("cannot find the VllmConfig needed for a forward context")
    param = next(model.parameters())
    out: dict[str, list[list[float]]] = {}
    hidden_states: torch.Tensor | None = None
    with torch.inference_mode(), set_forward_context(None, vllm_config):
        for expert_name, _ in moe_layers(model):
            block_name, block = _moe_block_for(model, expert_name)
            if hidden_states is None:
                hidden = int(getattr(block, "hidden_size", 0) or model.config.hidden_size)
                gen = torch.Generator().manual_seed(seed)
                hidden_states = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(param.device)
                out["input"] = hidden_states.float().cpu().tolist()
            result = block(hidden_states.clone())
            if isinstance(result, tuple):
                result = result[0]
            out[block_name] = result.float().cpu().tolist()
    return out


def run_worker_check(spec: str, model: torch.nn.Module) -> Any:
    """(Runs in the worker.) Import ``module:function`` there and call it on the model.

    Importing by name in the worker (rather than pickling the function in the driver) lets a
    check live in any module the worker can import, e.g. a test helper on ``PYTHONPATH``.
    """
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)(model)
