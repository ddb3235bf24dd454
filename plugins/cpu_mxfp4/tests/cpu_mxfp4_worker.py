"""Checks that run INSIDE vLLM's worker processes (``run_vllm(..., worker_checks=[...])``).

The worker is where quantreg's seam built the MoE methods and where the weights live, so what a
layer keeps resident, and which experts a rank holds, are asserted there, on the real model:

* :func:`packed_memory` -- every MoE layer runs ``cpu_mxfp4``, the layer's own MXFP4 parameters
  were freed, and the bytes kept (the kernel's packed experts plus every tensor the layer still
  references) are at most ``MEMORY_RATIO`` x the checkpoint's expert bytes for the rank's experts;
* :func:`expert_slices` -- on each expert-parallel rank, a token routed to global expert ``g``
  gives that checkpoint expert's float64 output when ``g`` is the rank's, and exactly 0 otherwise.

Imported by name in the worker (the test puts this directory on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

MEMORY_RATIO = 1.1
CHECKPOINT_PARTS = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
                    "down_proj_blocks", "down_proj_scales", "down_proj_bias")


def _layers(model: torch.nn.Module) -> list[tuple[str, Any]]:
    from quantreg_cpu_mxfp4.method import CpuMxfp4MoEMethod

    found = [(name, m) for name, m in model.named_modules() if hasattr(m, "quant_method")
             and hasattr(m, "local_num_experts")]
    methods = {type(m.quant_method).__name__ for _, m in found}
    assert found and all(isinstance(m.quant_method, CpuMxfp4MoEMethod) for _, m in found), methods
    return found


def _checkpoint(model: torch.nn.Module) -> str:
    from vllm.config import get_current_vllm_config_or_none

    config = getattr(model, "vllm_config", None) or get_current_vllm_config_or_none()
    assert config is not None, "no VllmConfig in the worker"
    return os.path.join(str(config.model_config.model), "model.safetensors")


def _stem(name: str) -> str:
    found = re.search(r"layers\.(\d+)\.", name)
    assert found, f"cannot tell the decoder layer of {name}"
    return f"model.layers.{found.group(1)}.mlp.experts."


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def packed_memory(model: torch.nn.Module) -> dict[str, Any]:
    from safetensors import safe_open

    path = _checkpoint(model)
    layers = []
    with safe_open(path, framework="pt") as f:
        for name, layer in _layers(model):
            method = layer.quant_method
            assert method.w13 is not None and method.w2 is not None, f"{name}: not packed"
            for param in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"):
                assert getattr(layer, param).numel() == 0, f"{name}: the layer still holds {param}"
            n_local, n_global = int(layer.local_num_experts), int(layer.global_num_experts)
            stem = _stem(name)
            checkpoint = 0
            for part in CHECKPOINT_PARTS:
                t = f.get_slice(stem + part)
                shape = t.get_shape()
                itemsize = 1 if "blocks" in part or "scales" in part else 2
                numel = 1
                for d in shape:
                    numel *= int(d)
                checkpoint += numel * itemsize * n_local // n_global
            kept = [*layer.parameters(), *layer.buffers()]
            resident = method.w13.nbytes + method.w2.nbytes + _storage_bytes([t for t in kept if t.numel()])
            ratio = resident / checkpoint
            assert ratio <= MEMORY_RATIO, f"{name}: {resident} bytes resident for {checkpoint} checkpoint bytes"
            layers.append({"name": name, "resident": resident, "checkpoint": checkpoint, "ratio": ratio})
    return {"pid": os.getpid(), "layers": layers}


def expert_slices(model: torch.nn.Module) -> dict[str, Any]:
    from safetensors import safe_open
    from vllm.distributed.parallel_state import get_ep_group, get_tensor_model_parallel_rank

    from quantreg.formats.mxfp4 import dequantize_mxfp4_f64
    from quantreg.models.gpt_oss_moe import moe_f64, relative_error

    ep = get_ep_group()
    ep_rank, ep_size = int(ep.rank_in_group), int(ep.world_size)
    path = _checkpoint(model)
    layers = []
    with safe_open(path, framework="pt") as f, torch.inference_mode():
        for name, layer in _layers(model):
            n_local, n_global = int(layer.local_num_experts), int(layer.global_num_experts)
            assert layer.quant_method.w13.num_experts == n_local, name
            stem = _stem(name)
            hidden = int(layer.quant_method.w2.rows)
            x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
            weights = torch.ones(3, 1)
            owned = []
            for g in range(n_global):
                ids = torch.full((3, 1), g, dtype=torch.int64)
                out = layer.quant_method._run(layer, x, weights, ids)
                if not ep_rank * n_local <= g < (ep_rank + 1) * n_local:
                    assert not bool(out.any()), f"{name} rank {ep_rank}: expert {g} is not local but contributed"
                    continue
                dense = [dequantize_mxfp4_f64(f.get_slice(stem + p + "_blocks")[g:g + 1],
                                              f.get_slice(stem + p + "_scales")[g:g + 1])
                         for p in ("gate_up_proj", "down_proj")]
                b13 = f.get_slice(stem + "gate_up_proj_bias")[g:g + 1]
                b2 = f.get_slice(stem + "down_proj_bias")[g:g + 1]
                ref = moe_f64(x, ids, weights, dense[0], dense[1], b13, b2, experts_min=g)
                err = relative_error(out, ref)
                assert err <= 1e-2, f"{name} rank {ep_rank}: expert {g} off the checkpoint's by {err:.3g}"
                owned.append(g)
            layers.append({"name": name, "owned": owned})
    return {"pid": os.getpid(), "ep_rank": ep_rank, "ep_size": ep_size,
            "tp_rank": int(get_tensor_model_parallel_rank()), "layers": layers}
