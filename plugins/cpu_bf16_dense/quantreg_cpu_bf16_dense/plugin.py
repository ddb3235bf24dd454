"""quantreg hook implementations: the ``cpu_bf16_dense_kernel`` method (strings only; no torch, no vLLM).

Written as a third party would: only quantreg's documented plugin API. The packaged table
``dense_bf16.yaml`` is NOT registered through ``register_tables``: installing the plugin changes no
decision; an operator turns it on by naming that table (``QUANTREG_CONFIG``) or copying its rule.
Whether the registry's default tables should choose it is a separate decision (issue 55, part 2).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path

import quantreg

PACKAGE = "quantreg_cpu_bf16_dense"
METHOD = "cpu_bf16_dense_kernel"


def table_path() -> Path:
    """The opt-in table shipped with the plugin (``QUANTREG_CONFIG=$(python -m quantreg_cpu_bf16_dense)``)."""
    return Path(str(resources.files(PACKAGE).joinpath("dense_bf16.yaml")))


@quantreg.hookimpl
def register_methods(register: Callable[[quantreg.Method], None]) -> None:
    register(quantreg.Method(
        name=METHOD,
        target=f"{PACKAGE}.method:CpuBf16DenseMethod",
        devices=("cpu",),
        requires=("torch", "vllm"),
        host=("cpu:avx2", "cpu:fma"),  # the baseline path; AVX-512 BF16 (vdpbf16ps) is taken at run time where present
        probe=f"{PACKAGE}.probe:kernel_available",
        options=(),
        layers=("attention", "dense", "lm_head"),
        description="the checkpoint's bf16 dense weights repacked once for this plugin's GEMV (AVX2+FMA or "
                    "AVX-512 BF16), fp32 products and accumulation, output rounded to bf16 once; blocked "
                    "for prefill",
    ))
