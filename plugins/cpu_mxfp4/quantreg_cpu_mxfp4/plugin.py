"""quantreg hook implementations: the ``cpu_mxfp4`` method and the package's rule table.

Written as a third party would write it: only quantreg's documented plugin API
(:data:`quantreg.hookimpl`, :class:`quantreg.Method`, the ``register_methods`` and
``register_tables`` hooks). Everything here is strings and tuples, so listing plugins or
resolving keys in every vLLM process imports neither torch nor vLLM nor the kernel; quantreg
imports the target only when it is chosen, and the probe only when a chain reaches it.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path

import quantreg

PACKAGE = "quantreg_cpu_mxfp4"
METHOD = "cpu_mxfp4"

#: Rule options the method accepts: the one list (``options.MethodOptions`` has a field for each,
#: which the plugin's tests check). Here so that registering imports nothing but this module.
OPTIONS = ("alpha", "limit", "routing", "precision")
#: The values ``routing`` and ``precision`` take (the one list of each; :mod:`.options` and :mod:`.kernel`
#: read them from here), declared in the registration so ``quantreg validate`` refuses another value.
ROUTINGS = ("auto", "topk_softmax", "softmax_topk", "vllm")
PRECISIONS = ("q8x2", "q8")
OPTION_VALUES = {"routing": ROUTINGS, "precision": PRECISIONS}


def rules_path() -> Path:
    return Path(str(resources.files(PACKAGE).joinpath("rules.yaml")))


def q8_table_path() -> Path:
    """The opt-in table ``q8.yaml`` (the plugin's chain with ``precision: q8``), NOT registered through
    ``register_tables``: plain Q8 trades ~1.5 % of accuracy for speed, the operator's call
    (``QUANTREG_CONFIG=$(python -m quantreg_cpu_mxfp4)``)."""
    return Path(str(resources.files(PACKAGE).joinpath("q8.yaml")))


@quantreg.hookimpl
def register_methods(register: Callable[[quantreg.Method], None]) -> None:
    register(quantreg.Method(
        name=METHOD,
        target=f"{PACKAGE}.method:CpuMxfp4MoEMethod",
        devices=("cpu",),
        requires=("torch", "vllm"),
        host=("cpu:avx2", "cpu:fma"),  # the kernel's baseline ISA: decided from host facts, before the probe
        probe=f"{PACKAGE}.probe:kernel_available",
        options=OPTIONS,
        option_values=OPTION_VALUES,
        expert_layout="packed",  # PackedExperts shares vLLM's packed storage: `quantreg plan` counts those bytes
        description="MXFP4 experts kept packed, fused dequant + GEMV/GEMM kernel (AVX2+FMA or AVX-512), any x86-64 CPU",
        numerics="MXFP4 expert weights used exactly; activations (before w13 and before w2) int8 per (token, "
                 "32-block) with fp32 scales -- precision q8: once (llama.cpp's vec_dot_mxfp4_q8_0); q8x2 "
                 "(default): plus the residual as a second int8 row (~1/254 of q8's error); int32 block dots, "
                 "fp32 accumulation; experts with many routed tokens (from 128 under q8x2, 1024 under q8): "
                 "exact weights times bf16 (AVX-512 BF16) or fp32 activations in torch's GEMM",
    ))


@quantreg.hookimpl
def register_tables(register: Callable[[Path | str], None]) -> None:
    register(rules_path())
