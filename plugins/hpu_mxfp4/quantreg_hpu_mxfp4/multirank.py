"""In-worker checks for multi-rank vLLM runs (tensor + expert parallel).

:func:`expert_slices` is meant for :func:`quantreg.testing.vllm_run.run_vllm`'s
``worker_checks`` (``"quantreg_hpu_mxfp4.multirank:expert_slices"``): vLLM runs it inside *every*
worker process, where the MoE layers were built and loaded. It asserts there, against the
worker's real process groups, that each expert-parallel rank holds its own slice of experts:

* the rank comes from vLLM's EP process group (``get_ep_group().rank_in_group``), not from
  the layer's config, so a method that read the wrong field would be caught;
* the method's kernel range (``layer.moe_op.experts_min/max``) is ``ep_rank * local ..
  ep_rank * local + local - 1`` (linear placement, which vLLM's ``expert_map`` must agree with);
* the weights the kernel is bound to are byte-identical to that slice of the checkpoint on disk.

It returns what it saw (JSON) so the test can also compare the ranks with each other. The
module imports torch and vLLM only inside the function: it is harness code that runs in vLLM.

Why in this plugin, not in quantreg's kit: ``moe_op`` and its bound ``w13``/``w2`` tensors are
this plugin's private attributes (issue 24.1: plugin-specific checks live in the plugin).
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _checkpoint_dir(model: torch.nn.Module) -> str:
    from vllm.config import get_current_vllm_config_or_none  # type: ignore[import-not-found,unused-ignore]

    vllm_config = getattr(model, "vllm_config", None) or get_current_vllm_config_or_none()
    if vllm_config is None:
        raise RuntimeError("cannot find the VllmConfig (needed for the checkpoint path)")
    return str(vllm_config.model_config.model)


def _same_bytes(bound: torch.Tensor, stored: torch.Tensor) -> bool:
    """Whether the kernel's tensor holds exactly the checkpoint's values (layouts may differ in shape only)."""
    import torch

    if bound.numel() != stored.numel():
        return False
    return bool(torch.equal(bound.reshape(-1).cpu(), stored.reshape(-1).to(bound.dtype)))


def expert_slices(model: torch.nn.Module) -> dict[str, Any]:
    """(Runs in the worker.) Assert this EP rank's expert slice; return ranks, ranges, methods."""
    from vllm.distributed.parallel_state import (  # type: ignore[import-not-found,unused-ignore]
        get_ep_group,
        get_tensor_model_parallel_rank,
    )

    from quantreg.testing.vllm_probes import moe_layers, qualname
    from quantreg.tiny.checkpoint import load_tensors

    ep = get_ep_group()
    ep_rank, ep_size = int(ep.rank_in_group), int(ep.world_size)
    tensors = load_tensors(_checkpoint_dir(model))
    layers = []
    for name, layer in moe_layers(model):
        found = re.search(r"layers\.(\d+)\.", name)
        assert found, f"cannot tell the decoder layer of MoE module {name}"
        stem = f"model.layers.{found.group(1)}.mlp.experts."
        n_global, n_local = int(layer.global_num_experts), int(layer.local_num_experts)
        assert n_local * ep_size == n_global, f"{name}: {n_local} local experts x {ep_size} ranks != {n_global}"
        lo, hi = ep_rank * n_local, ep_rank * n_local + n_local - 1
        op = getattr(layer, "moe_op", None)
        assert op is not None, f"{name}: {qualname(layer.quant_method)} bound no moe_op"
        assert (op.experts_min, op.experts_max) == (lo, hi), (
            f"{name} on EP rank {ep_rank}/{ep_size}: kernel range {op.experts_min}..{op.experts_max}, "
            f"expected {lo}..{hi}")
        expert_map = layer.expert_map
        if expert_map is not None:  # vLLM's own global -> local map must say the same
            expected_map = [g - lo if lo <= g <= hi else -1 for g in range(n_global)]
            assert [int(v) for v in expert_map.tolist()] == expected_map, (name, expert_map.tolist(), expected_map)
        for part, stored in (("w13", "gate_up_proj"), ("w2", "down_proj")):
            bound = getattr(op, part)
            for i, g in enumerate(range(lo, hi + 1)):
                assert _same_bytes(bound.weight[i], tensors[stem + stored + "_blocks"][g]), (name, part, "blocks", g)
                assert bound.scale is not None and _same_bytes(bound.scale[i], tensors[stem + stored + "_scales"][g]), (
                    name, part, "scales", g)
                assert bound.bias is not None and _same_bytes(bound.bias[i], tensors[stem + stored + "_bias"][g]), (
                    name, part, "bias", g)
        layers.append({"name": name, "quant_method": qualname(layer.quant_method), "experts_min": lo,
                       "experts_max": hi, "local_num_experts": n_local, "global_num_experts": n_global})
    assert layers, "this worker has no MoE layers"
    return {"pid": os.getpid(), "ep_rank": ep_rank, "ep_size": ep_size,
            "tp_rank": int(get_tensor_model_parallel_rank()), "layers": layers}
