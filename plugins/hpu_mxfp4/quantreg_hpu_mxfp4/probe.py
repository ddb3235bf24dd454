"""Availability probes for the Gaudi methods: quick, side-effect free answers that never raise.

quantreg calls a probe when a rule's chain reaches the method. Without the Habana stack the
answer comes from ``importlib.util.find_spec`` alone (no torch import); with it, the probe imports
``habana_frameworks.torch`` (which vllm-gaudi has loaded already on a Gaudi host), asks for a
device and looks the kernel up in the ``hpu::mixture_of_experts`` overload packet.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

NATIVE_OPS = ("bias_mxfp4_fused_weights", "mxfp4_fused_weights")
BF16_OPS = ("bias_fused_weights", "fused_weights")


def native_mxfp4_available() -> tuple[bool, str]:
    """``hpu_mxfp4``: a Gaudi device and the native MXFP4 MoE kernels."""
    return _available(NATIVE_OPS)


def bf16_moe_available() -> tuple[bool, str]:
    """``hpu_mxfp4_dequant``: a Gaudi device and the bf16 MoE kernels."""
    return _available(BF16_OPS)


def _available(ops: tuple[str, ...]) -> tuple[bool, str]:
    try:
        return _check(ops)
    except Exception as exc:  # a probe answers; it never breaks resolution
        return False, f"probe failed: {type(exc).__name__}: {exc}"


def _check(ops: tuple[str, ...]) -> tuple[bool, str]:
    try:
        spec = importlib.util.find_spec("habana_frameworks")
    except (ImportError, ValueError):
        spec = None
    if spec is None and "habana_frameworks" not in sys.modules:
        return False, "no HPU: habana_frameworks (the Gaudi PyTorch bridge) is not installed"
    try:
        importlib.import_module("habana_frameworks.torch")
    except Exception as exc:
        return False, f"no HPU: importing habana_frameworks.torch failed: {type(exc).__name__}: {exc}"
    import torch

    hpu: Any = getattr(torch, "hpu", None)
    if hpu is None or not hpu.is_available() or hpu.device_count() < 1:
        return False, "no HPU device visible to this process"
    packet = _moe_packet(torch)
    if packet is None:
        return False, "torch.ops.hpu.mixture_of_experts is not registered (Gaudi software stack too old?)"
    missing = [op for op in ops if op not in packet.overloads()]
    if missing:
        return False, f"torch.ops.hpu.mixture_of_experts lacks {', '.join(missing)} (Gaudi software stack too old?)"
    return True, f"HPU device and torch.ops.hpu.mixture_of_experts.{{{', '.join(ops)}}} present"


def _moe_packet(torch: Any) -> Any:
    try:
        return torch.ops.hpu.mixture_of_experts
    except (AttributeError, RuntimeError):
        return None

