"""The availability probe of ``cpu_mxfp4``: quick, side-effect free, never raises, imports no torch.

quantreg calls it when a rule's chain reaches the method: on a CPU without AMX that is every
``explain``/``plan`` of a GPT-OSS MXFP4 key (the plugin's chain ``[vllm, cpu_mxfp4]`` passes
``vllm`` over there), so it must stay as cheap as a decision. What it needs of the CPU (AVX2+FMA)
the method declares (``host: cpu:avx2, cpu:fma``), decided by quantreg from host facts before
this runs; here only "was the extension built?": the compiled module's file is looked up without
loading it (loading imports torch). An extension that is there but cannot load (a torch it was not
built against) fails when the method is built, where the seam falls back (lenient) or stops
(strict) with that reason; :func:`quantreg_cpu_mxfp4.kernel.status` is the full check.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXTENSION = "quantreg_cpu_mxfp4._C"
BUILD_FAILED = Path(__file__).with_name("BUILD_FAILED.txt")
"""Written by setup.py when the build failed: the one line it printed."""


def build_failure() -> str | None:
    """Why the build failed, as setup.py recorded it, or ``None`` (no record: built, or never tried)."""
    try:
        return BUILD_FAILED.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def kernel_available() -> tuple[bool, str]:
    """``(True, "kernel built: <file>")`` or ``(False, "unavailable: extension not built (<why>)")``."""
    try:
        spec = importlib.util.find_spec(EXTENSION)
    except Exception as exc:  # a broken package must not break resolution
        return False, f"unavailable: extension not built ({type(exc).__name__}: {exc})"
    if spec is None or spec.origin is None:
        failure = build_failure()
        why = f"the build failed: {failure}" if failure is not None else f"no module {EXTENSION}"
        return False, f"unavailable: extension not built ({why})"
    return True, f"kernel built: {Path(spec.origin).name}"
