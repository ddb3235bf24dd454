"""quantreg hook implementations: the four methods and the package's rule table.

Everything here is strings and tuples, so listing plugins or resolving keys never imports
torch, vLLM or the Gaudi stack; quantreg imports a target only when it is chosen or probed.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import quantreg

from .keeper import KEEPER

PACKAGE = "quantreg_hpu_mxfp4"

#: Rule options every method of the plugin accepts: the one list (``options.MethodOptions`` has a
#: field for each, which its tests check). Here, not in ``options``, so that registering the plugin
#: in every vLLM process imports nothing but this module.
OPTIONS = ("alpha", "limit", "routing")
#: ... and those only the bf16 (dequantising) method accepts.
SLICING_OPTIONS = ("max_experts_per_slice",)
SLICING_METHODS = ("hpu_mxfp4_dequant",)


def rules_path() -> Path:
    return Path(str(resources.files(PACKAGE).joinpath("rules.yaml")))


def _native_mxfp4(name: str, cls: str, description: str) -> quantreg.Method:
    """A method on Gaudi's native MXFP4 op: packed experts, the habana stack, the same probe and options."""
    return quantreg.Method(name=name, expert_layout="packed", target=f"{PACKAGE}.method:{cls}", devices=("hpu",),
                           requires=("habana_frameworks",), probe=f"{PACKAGE}.probe:native_mxfp4_available",
                           options=OPTIONS, description=description)


@quantreg.hookimpl
def register_methods(register: Callable[[quantreg.Method], None]) -> None:
    register(_native_mxfp4("hpu_mxfp4", "HpuMxfp4MoEMethod",
                           "Gaudi native MXFP4 MoE kernel (bias_mxfp4_fused_weights / mxfp4_fused_weights)"))
    register(quantreg.Method(
        name="hpu_mxfp4_dequant",
        expert_layout="bf16",
        target=f"{PACKAGE}.method:HpuMxfp4DequantMoEMethod",
        devices=("hpu",),
        requires=("habana_frameworks",),
        probe=f"{PACKAGE}.probe:bf16_moe_available",
        options=(*OPTIONS, *SLICING_OPTIONS),
        description="MXFP4 dequantised to bf16 at load, Gaudi bf16 MoE kernel (bias_fused_weights / fused_weights)",
    ))
    register(_native_mxfp4("hpu_mxfp4_gathered", "HpuMxfp4GatheredMoEMethod",
                           "Gaudi native MXFP4 kernel over one slot per routed (token, expert) pair: reads only "
                           "the experts a small batch routes to (vllm-gaudi #1731's gathered path; for decode)"))
    register(quantreg.Method(
        name="mxfp4_reference",
        expert_layout="packed",
        target=f"{PACKAGE}.method:Mxfp4ReferenceMoEMethod",
        requires=("torch", "vllm"),
        options=OPTIONS,
        description="the Gaudi MXFP4 method computed by a pure-torch reference; runs on any device",
    ))


@quantreg.hookimpl
def register_tables(register: Callable[[Path | str], None]) -> None:
    register(rules_path())


@quantreg.hookimpl
def register_quant_config_keepers(register: Callable[[Any], None]) -> None:
    """vllm-gaudi's GPT-OSS MXFP4 strip follows the table (see :mod:`quantreg_hpu_mxfp4.vllm_gaudi`)."""
    register(KEEPER)


@quantreg.hookimpl
def doctor_findings(register: Callable[[quantreg.Finding], None], resolve: Callable[[quantreg.Key], quantreg.Decision],
                    device: str) -> None:
    """What vllm-gaudi will do to each GPT-OSS key on this host (``plan``, ``explain``, ``doctor`` and the
    start-up line all print it: quantreg asks this hook, it never re-derives it)."""
    from .vllm_gaudi import findings

    for finding in findings(resolve, device):
        register(finding)
