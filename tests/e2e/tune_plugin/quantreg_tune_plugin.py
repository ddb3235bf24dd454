"""A throwaway plugin for the ``quantreg tune`` tests: one correct-but-slow and one fast-but-wrong method.

``tune_slow`` is ``mxfp4_reference`` run twice plus a fixed sleep per forward (same numbers, always slower),
so tune must rank it last; ``tune_wrong`` is ``mxfp4_reference`` reading w13 with its two E2M1
nibbles swapped (the classic unpacking mistake: as fast, wrong numbers), so tune must refuse it.
Installed as a real distribution (dist-info on ``PYTHONPATH``).
"""

from __future__ import annotations

from collections.abc import Callable

import quantreg


@quantreg.hookimpl
def register_methods(register: Callable[[quantreg.Method], None]) -> None:
    register(quantreg.Method(name="tune_slow", target="quantreg_tune_methods:SlowReferenceMethod",
                             requires=("torch", "vllm"), host=("cpu:avx2",),
                             description="mxfp4_reference plus a sleep per forward (correct, slow)"))
    register(quantreg.Method(name="tune_wrong", target="quantreg_tune_methods:NibblesSwappedMethod",
                             requires=("torch", "vllm"),
                             description="mxfp4_reference with w13 nibbles swapped (fast, wrong)"))
