"""Sequence-parallel MoE with one DP rank (TP > 1 + EP, all-gather/reduce-scatter backend) on vllm-gaudi.

What vLLM 0.32's runner does (``MoERunner._forward_impl``): when ``dp_size > 1`` or
``moe_config.is_sequence_parallel`` and the method has no internal modular kernel
(``do_naive_dispatch_combine``), it all-gathers tokens over the EP group *before* the method
(``_maybe_dispatch``) and reduce-scatters the output *after* it (``_maybe_combine``). Under that
runner a method must not gather anything itself: ``mxfp4_reference`` (stock vLLM) does not.

What vllm-gaudi's runner does: with ``HPU_FUSED_MOE=1`` (its default) it replaces
``MoERunner.forward`` by ``patched_fused_moe_forward``, whose ``dp_size == 1`` fast path skips
``_maybe_dispatch`` but still calls ``_maybe_combine``. With sequence parallelism and one DP
rank the reduce-scatter is then unpaired and halves the token count, so vllm-gaudi's bf16
method all-gathers tokens, ids and weights itself there (``dispatch_tensor(t, None, True)``);
its MXFP4 method does not (a bug on vllm-gaudi main: the block's final reshape fails). The
Gaudi methods here gather exactly when that fast path will skip the dispatch, for both the
native and the dequantised kernels; with ``HPU_FUSED_MOE=0`` the stock runner dispatches and
they gather nothing (gathering then would double the tokens).

vLLM 0.32 itself never builds this case: ``ParallelConfig.use_sequence_parallel_moe`` also needs
``data_parallel_size > 1`` there, so ``is_sequence_parallel`` implies ``dp_size > 1`` and the
existing DP gather applies. The rule above is for the vLLM versions vllm-gaudi's comment
describes, where sequence-parallel MoE runs with one DP rank.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch

FUSED_MOE_MODULE = "vllm_gaudi.ops.hpu_fused_moe"
DP_UTILS = "vllm_gaudi.v1.worker.hpu_dp_utils"


def runner_skips_dispatch(moe_config: Any) -> bool:
    """True when vllm-gaudi's fast-path runner will combine without having dispatched."""
    if not bool(getattr(moe_config, "is_sequence_parallel", False)) or int(moe_config.dp_size) != 1:
        return False
    fused_moe = sys.modules.get(FUSED_MOE_MODULE)  # imported by vllm-gaudi's register_ops when it is there
    return fused_moe is not None and bool(getattr(fused_moe, "_MOE_COMPILE", False))


def gather(x: torch.Tensor, ids: torch.Tensor,
           weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-gather over the EP group with vllm-gaudi's helper (it allocates the output itself)."""
    utils: Any = importlib.import_module(DP_UTILS)
    return (utils.dispatch_tensor(x, None, True), utils.dispatch_tensor(ids, None, True),
            utils.dispatch_tensor(weights, None, True))
