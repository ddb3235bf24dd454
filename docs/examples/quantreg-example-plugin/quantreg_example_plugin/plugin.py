"""quantreg hooks: one method and one rule table. Strings only: nothing heavy is imported here."""

from __future__ import annotations

import os
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import quantreg

DISABLE_ENV = "QUANTREG_EXAMPLE_DISABLE"


@quantreg.hookimpl
def register_methods(register: Callable[[quantreg.Method], None]) -> None:
    register(quantreg.Method(
        name="example_mxfp4",
        target="quantreg_example_plugin.method:ExampleMxfp4MoEMethod",
        devices=("cpu",),
        requires=("torch", "vllm"),
        probe="quantreg_example_plugin.plugin:available",
        options=("compute_dtype",),
        expert_layout="bf16",
        description="GPT-OSS MXFP4 experts dequantised to bf16 at load, computed in torch (example)",
    ))


@quantreg.hookimpl
def register_tables(register: Callable[[Path | str], None]) -> None:
    register(Path(str(resources.files("quantreg_example_plugin").joinpath("rules.yaml"))))


def available() -> tuple[bool, str]:
    """The probe: answer fast, never raise. A real one asks whether its device and kernels are there."""
    if os.environ.get(DISABLE_ENV) == "1":
        return False, f"disabled by {DISABLE_ENV}=1"
    return True, "pure torch; runs on any CPU"
