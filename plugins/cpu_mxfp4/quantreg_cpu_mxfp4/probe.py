"""The availability probe of ``cpu_mxfp4``: quick, side-effect free, never raises, imports no torch.

quantreg calls it when a rule's chain reaches the method: on a CPU without AMX that is every
``explain``/``plan`` of a GPT-OSS MXFP4 key (the plugin's chain ``[vllm, cpu_mxfp4]`` passes
``vllm`` over there), so it must stay as cheap as a decision. What it needs of the CPU (AVX2+FMA)
the method declares (``host: cpu:avx2, cpu:fma``), decided by quantreg from host facts before
this runs; here "was the kernel built?" and "which ISA path will it take?": the library file is
looked up without loading it (loading it before torch would bring in a second OpenMP runtime), and
the path is read from the CPU flags and ``QUANTREG_CPU_MXFP4_ISA`` the way the kernel decides it.
A library that is there but cannot load fails when the method is built, where the seam falls back
(lenient) or stops (strict) with that reason; :func:`quantreg_cpu_mxfp4.kernel.status` is the
full check.
"""

from __future__ import annotations

import os
from pathlib import Path

LIBRARY = Path(__file__).with_name("libquantreg_cpu_mxfp4.so")
"""The kernel (a plain C library; kernel.LIBRARY)."""
ISA_ENV = "QUANTREG_CPU_MXFP4_ISA"
"""The setting forcing the kernel's ISA path: named here, where no torch is imported; kernel.py imports it."""
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
BUILD_FAILED = Path(__file__).with_name("BUILD_FAILED.txt")
"""Written by setup.py when the build failed: the one line it printed."""


def build_failure() -> str | None:
    """Why the build failed, as setup.py recorded it, or ``None`` (no record: built, or never tried)."""
    try:
        return BUILD_FAILED.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa_path() -> str:
    """The path the kernel will take here, decided as :func:`quantreg_cpu_mxfp4.kernel.isa` does:
    ``"avx512 (AVX-512 VNNI)"`` or ``"avx2 (AVX2+FMA)"``, with ``(forced by QUANTREG_CPU_MXFP4_ISA)``."""
    wanted = os.environ.get(ISA_ENV, "").strip().lower()
    if wanted == "avx2":
        return f"avx2 (AVX2+FMA, forced by {ISA_ENV})"
    return "avx512 (AVX-512 VNNI)" if AVX512_FLAGS <= _cpu_flags() else "avx2 (AVX2+FMA)"


def kernel_available() -> tuple[bool, str]:
    """``(True, "kernel built: <file>, ISA path <path>")`` or
    ``(False, "unavailable: extension not built (<why>)")``."""
    try:
        built = LIBRARY.is_file()
    except OSError as exc:  # a broken package must not break resolution
        return False, f"unavailable: extension not built ({type(exc).__name__}: {exc})"
    if not built:
        failure = build_failure()
        why = f"the build failed: {failure}" if failure is not None else f"no {LIBRARY.name} in the package"
        return False, f"unavailable: extension not built ({why})"
    return True, f"kernel built: {LIBRARY.name}, ISA path {isa_path()}"
