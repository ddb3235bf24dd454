"""vLLM objects the core needs by name, looked up here so only ``quantreg/vllm/`` imports vLLM.

The core calls these lazily, and :func:`fused_moe_method_base` only once vLLM is already in
``sys.modules`` (:mod:`quantreg.methods` checks): asking must never be what imports vLLM, which
costs seconds.
"""

from __future__ import annotations

from typing import Any


def fused_moe_method_base() -> type[Any] | None:
    """vLLM's ``FusedMoEMethodBase``, or ``None`` if this vLLM lacks it (imports vLLM)."""
    try:
        from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
    except Exception:  # a vLLM without it: the class check is skipped, like without vLLM
        return None
    return FusedMoEMethodBase  # type: ignore[no-any-return]


def vllm_device() -> tuple[str | None, str]:
    """Ask vLLM which device it runs on (slow: imports it). Returns (device, how we know)."""
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # vLLM missing or broken: doctor reports, never crashes
        return None, f"vLLM not importable: {type(exc).__name__}: {exc}"
    return str(current_platform.device_type), "vllm.platforms.current_platform.device_type"


def quantize_method_base() -> type[Any] | None:
    """vLLM's ``QuantizeMethodBase`` (every linear and lm_head method's base), or ``None`` if missing."""
    try:
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    except Exception:  # a vLLM without it: the class check is skipped, like without vLLM
        return None
    return QuantizeMethodBase  # type: ignore[no-any-return]
