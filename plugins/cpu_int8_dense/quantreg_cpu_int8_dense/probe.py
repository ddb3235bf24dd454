"""Are vLLM-CPU's oneDNN int8 ops here? Asked only when a chain reaches the method.

Inside vLLM (its custom ops already loaded) the ops themselves are looked up. Outside it
(``quantreg explain`` / ``list``) importing vLLM would cost seconds, so only the compiled
extension's presence is checked; the ops are checked again when vLLM decides.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

OPS = ("create_onednn_scaled_mm_handler", "onednn_scaled_mm", "dynamic_scaled_int8_quant")


def ops_available() -> tuple[bool, str]:
    if "vllm._custom_ops" in sys.modules:
        import torch

        missing = [op for op in OPS if not hasattr(torch.ops._C, op)]
        if missing:
            return False, f"this vLLM build lacks torch.ops._C.{', '.join(missing)} (not a vLLM-CPU x86 build)"
        return True, "vLLM-CPU's oneDNN W8A8 int8 GEMM is loaded"
    spec = importlib.util.find_spec("vllm")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []
    if not any(root.glob("_C*.so") for root in roots):
        return False, "vLLM's compiled ops (vllm/_C*.so) are not installed"
    return True, "vLLM's compiled ops are installed (the int8 ops are checked when vLLM loads them)"
