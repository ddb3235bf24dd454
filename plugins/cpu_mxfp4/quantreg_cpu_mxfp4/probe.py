"""The availability probe of ``cpu_mxfp4``: quick, side-effect free, never raises.

quantreg calls it when a rule's chain reaches the method. It answers from the kernel's own
:func:`~quantreg_cpu_mxfp4.kernel.status` (an extension that was not built, or a CPU without
AVX2+FMA, is "unavailable" with that reason), so a chain such as ``[vllm, cpu_mxfp4]`` moves on
instead of failing while vLLM builds the model.
"""

from __future__ import annotations

import importlib


def kernel_available() -> tuple[bool, str]:
    """``(True, "kernel ready: <isa> path")`` or ``(False, "unavailable: <why>")``."""
    try:
        kernel = importlib.import_module("quantreg_cpu_mxfp4.kernel")
    except Exception as exc:  # an unbuilt or broken extension must not break resolution
        return False, f"unavailable: extension not built ({type(exc).__name__}: {exc})"
    try:
        ok, why = kernel.status()
    except Exception as exc:  # the API says status() never raises; a probe answers even if it does
        return False, f"unavailable: kernel status failed ({type(exc).__name__}: {exc})"
    if not ok:
        return False, f"unavailable: {why}"
    try:
        path = kernel.isa()
    except Exception as exc:
        return False, f"unavailable: kernel isa() failed ({type(exc).__name__}: {exc})"
    return True, f"kernel ready ({why}): {path} path"
