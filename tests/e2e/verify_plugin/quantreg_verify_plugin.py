"""A throwaway plugin for the ``verify:`` end-to-end tests: one deliberately broken MXFP4 method.

``nibbles_swapped`` is ``mxfp4_reference`` reading every packed byte of w13 with its two E2M1
codes swapped (the classic MXFP4 unpacking mistake), so a table that verifies it against
``mxfp4_reference`` must report the layers it covers. Installed as a real distribution (dist-info
on ``PYTHONPATH``) so every vLLM process discovers it through the ``quantreg`` entry points.
"""

from __future__ import annotations

from collections.abc import Callable

import quantreg


@quantreg.hookimpl
def register_methods(register: Callable[[quantreg.Method], None]) -> None:
    register(quantreg.Method(name="nibbles_swapped", target="quantreg_verify_methods:NibblesSwappedMethod",
                             requires=("torch", "vllm"),
                             description="mxfp4_reference with the two nibbles of each w13 byte swapped (broken)"))
