"""Keep vLLM's GPT-OSS MXFP4 weights, run your own experts: the base class and the constructor that allow it.

Why this exists: a plugin that computes MXFP4 experts itself (a CPU kernel, an accelerator's op,
a reference) wants exactly the parameters vLLM's ``GptOssMxfp4MoEMethod.create_weights`` registers
(uint8 MXFP4 blocks, E8M0 scales, bf16 biases, and the padding the GPT-OSS and Mixtral loaders
expect: both write into these parameters), but not that class's constructor, which selects a
CUDA/XPU backend and refuses where none exists. Subclassing it and calling
:func:`init_without_backend` instead of ``super().__init__`` gives a method with vLLM's weights and
no backend; the plugin then replaces ``process_weights_after_loading`` and the forward.

Without a backend (``mxfp4_backend = None``) vLLM 0.32 rounds the intermediate size up to a
multiple of 64 and zero-fills the padding; zero rows and columns add exactly zero, so a method
may compute through them unchanged.

Imports vLLM (its MXFP4 module): import this from a method module, never at ``register()``.
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.quantization import mxfp4 as vllm_mxfp4

__all__ = ["init_without_backend", "upstream_mxfp4_method"]

_UPSTREAM_NAME = "GptOssMxfp4MoEMethod"


def upstream_mxfp4_method() -> type[Any]:
    """vLLM's own ``GptOssMxfp4MoEMethod``, even if a platform plugin rebound the module attribute.

    vllm-gaudi, for one, rebinds ``mxfp4.GptOssMxfp4MoEMethod`` to its own subclass; a method
    built on that would inherit the platform's behaviour. The original is found on the bound
    class's MRO (the defining module and name), else the bound class itself.
    """
    bound: type[Any] = getattr(vllm_mxfp4, _UPSTREAM_NAME)
    for cls in bound.__mro__:
        if cls.__module__ == vllm_mxfp4.__name__ and cls.__name__ == _UPSTREAM_NAME:
            return cls
    return bound


def init_without_backend(method: Any, moe: Any) -> None:
    """Initialise ``method`` (a subclass of :func:`upstream_mxfp4_method`) without selecting a backend.

    Runs ``FusedMoEMethodBase.__init__`` and sets the attributes ``GptOssMxfp4MoEMethod``'s own
    ``create_weights`` and helpers read, with no backend: ``mxfp4_backend``, ``experts_cls`` and
    ``moe_kernel`` None, no precision configs, an empty permute cache, ``max_capture_size`` from
    ``moe`` (0 if absent). Call it in place of ``super().__init__(moe)``.
    """
    FusedMoEMethodBase.__init__(method, moe)
    method.weight_dtype = "gpt_oss_mxfp4"
    method.mxfp4_backend = None
    method.experts_cls = None
    method.moe_kernel = None
    method.max_capture_size = getattr(moe, "max_capture_size", 0)
    method._cache_permute_indices = {}
    method.w13_precision_config = None
    method.w2_precision_config = None
