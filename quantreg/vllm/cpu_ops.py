"""vLLM's CPU MoE ops wherever the installed release keeps them, always called with the activation named.

Why a shim: vLLM 0.34 moved the CPU MoE ops (``fused_experts_cpu``, ``CPUQuantMethod``,
``CPUActMethod``, ``convert_weight_packed*``, ``cpu_fused_moe``, ``cpu_prepack_moe_weight``...)
out of ``vllm._custom_ops`` into a new ``vllm._cpu_ops``; code that imports them from one module
breaks on the other release. And since 0.33 ``fused_experts_cpu`` takes an ``act_method`` whose
default is SiLU-and-mul: GPT-OSS needs SwiGLU-OAI, so a call with the defaults computes the wrong
activation without any error. :func:`cpu_op` finds a name in the module that has it (0.34's first),
and :func:`fused_experts_cpu` requires the activation and passes it wherever the signature takes it
(0.32 has no ``act_method``: its kernel computes SwiGLU-OAI when ``alpha``/``limit`` are given).

Imports vLLM only when called. ``tests/test_vllm_cpu_ops.py`` runs it against 0.32's layout (the
installed vLLM) and a fake 0.34 layout built in the test (0.34 cannot run on this CPU: it has no
CPU Triton build on x86, see docs/compat.md).
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any

#: Where the CPU ops live, newest layout first: 0.34+ ``vllm._cpu_ops``, 0.32/0.33 ``vllm._custom_ops``.
MODULES = ("vllm._cpu_ops", "vllm._custom_ops")
#: quantreg's activation names -> ``CPUActMethod`` members (0.33+).
ACT_METHODS = {"silu": "SILU_AND_MUL", "swigluoai": "SWIGLU"}
#: GPT-OSS's SwiGLU-OAI parameters (quantreg.models.gpt_oss), what 0.32's kernel needs to compute it.
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def _modules() -> list[ModuleType]:
    found = []
    for name in MODULES:
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            continue
    return found


def load() -> list[str]:
    """Import the CPU ops modules this vLLM has (which registers ``torch.ops._C``'s CPU kernels); their names."""
    return [module.__name__ for module in _modules()]


def cpu_op(name: str) -> Any:
    """``name`` from the first of :data:`MODULES` that has it; ``LookupError`` naming both when none does."""
    for module in _modules():
        if hasattr(module, name):
            return getattr(module, name)
    raise LookupError(f"vLLM's CPU op {name!r} is in none of {', '.join(MODULES)} (is this a CPU build of vLLM?)")


def where(name: str) -> str | None:
    """The module that provides ``name`` here (``vllm._cpu_ops`` or ``vllm._custom_ops``), or ``None``."""
    for module in _modules():
        if hasattr(module, name):
            return module.__name__
    return None


def act_method(activation: str) -> Any:
    """The ``CPUActMethod`` member for ``activation`` (``silu`` / ``swigluoai``); ``None`` before 0.33."""
    if activation not in ACT_METHODS:
        raise ValueError(f"activation {activation!r}: expected one of {', '.join(ACT_METHODS)}")
    try:
        enum = cpu_op("CPUActMethod")
    except LookupError:
        return None
    return getattr(enum, ACT_METHODS[activation])


def fused_experts_cpu(*args: Any, activation: str, **kwargs: Any) -> Any:
    """vLLM's ``fused_experts_cpu`` with the activation passed explicitly (never its SiLU default).

    0.33+: ``act_method`` is set from ``activation``. 0.32 (no ``act_method``): SwiGLU-OAI needs
    ``alpha`` and ``limit`` (filled with GPT-OSS's 1.702 / 7.0 when not given); SiLU cannot be asked
    for there, so ``activation="silu"`` is refused rather than silently computing something else.
    """
    fn = cpu_op("fused_experts_cpu")
    method = act_method(activation)
    params = inspect.signature(fn).parameters
    if "act_method" in params:
        kwargs["act_method"] = method
    elif activation == "swigluoai":
        kwargs.setdefault("alpha", SWIGLU_ALPHA)
        kwargs.setdefault("limit", SWIGLU_LIMIT)
    else:
        raise ValueError("this vLLM's fused_experts_cpu has no act_method: it computes SwiGLU-OAI only")
    return fn(*args, **kwargs)


def cpu_fused_moe(*args: Any, activation: str, **kwargs: Any) -> Any:
    """vLLM's ``cpu_fused_moe`` (the unquantised CPU path) with ``act`` given by name, never defaulted."""
    if activation not in ACT_METHODS:
        raise ValueError(f"activation {activation!r}: expected one of {', '.join(ACT_METHODS)}")
    kwargs["act"] = activation
    return cpu_op("cpu_fused_moe")(*args, **kwargs)
