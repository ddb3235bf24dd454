"""The availability probe of ``cpu_mxfp4``: quick, side-effect free, never raises, imports no torch.

quantreg calls it when a rule's chain reaches the method: on a CPU without AMX that is every
``explain``/``plan`` of a GPT-OSS MXFP4 key (the plugin's chain ``[vllm, cpu_mxfp4]`` passes
``vllm`` over there), so it must stay as cheap as a decision. What it needs of the CPU (AVX2+FMA)
the method declares (``host: cpu:avx2, cpu:fma``), decided by quantreg from host facts before
this runs; here "does the kernel load?" and "which ISA path will it take?".

"Available" means loadable: :func:`load_library` has a child process load the library first (a
constructor that blocks or crashes cannot reach this process: :mod:`quantreg.native`), then loads it
here once per process (cached); the child checks its ABI version and entry points, so a library of
another ABI version, a truncated file or a file that is not a library is passed over here -- in
``explain``, ``plan`` and the seam's chain, with the reason -- instead of being built and failing at
the first forward (issue 46, class 2). The method's constructor asks the same question
(:func:`quantreg_cpu_mxfp4.kernel.status`), so a build that succeeds has a kernel that runs. Loading
needs no torch: where torch ships its own ``libgomp.so.1`` (pip wheels, ``torch/lib``), that file is
loaded first, so the library's OpenMP dependency resolves to the runtime torch will use later and a
process never holds two.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from functools import cache
from pathlib import Path

import quantreg.native as native
from quantreg.host import hardware_cpu_flags
from quantreg.installed import build_failure as recorded_build_failure

LIBRARY = Path(__file__).with_name("libquantreg_cpu_mxfp4.so")
"""The kernel (a plain C library; kernel.LIBRARY)."""
ABI_VERSION = 3
"""The C ABI this package's Python side speaks (``qr_abi_version()`` of ``csrc/moe.cpp``): bump both together."""
ENTRY_POINTS = ("qr_abi_version", "qr_cpu_supports", "qr_moe_forward")
"""The library's C functions the kernel calls: all must be exported for it to count as loadable."""
ISA_ENV = "QUANTREG_CPU_MXFP4_ISA"
"""The setting forcing the kernel's ISA path: named here, where no torch is imported; kernel.py imports it."""
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
BUILD_FAILED = Path(__file__).with_name("BUILD_FAILED.txt")
"""Written by setup.py when the build failed: the one line it printed."""


def build_failure() -> str | None:
    """Why the build failed, as setup.py recorded it, or ``None`` (no record: built, or never tried)."""
    return recorded_build_failure(BUILD_FAILED)


def isa_path() -> str:
    """The path the kernel will take here, decided as :func:`quantreg_cpu_mxfp4.kernel.isa` does:
    ``"avx512 (AVX-512 VNNI)"`` or ``"avx2 (AVX2+FMA)"``, with ``(forced by QUANTREG_CPU_MXFP4_ISA)``."""
    wanted = os.environ.get(ISA_ENV, "").strip().lower()
    if wanted == "avx2":
        return f"avx2 (AVX2+FMA, forced by {ISA_ENV})"
    return "avx512 (AVX-512 VNNI)" if AVX512_FLAGS <= hardware_cpu_flags() else "avx2 (AVX2+FMA)"


def _torch_openmp() -> Path | None:
    """torch's own ``libgomp.so.1`` (pip wheels ship it in ``torch/lib``), found without importing torch."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    candidate = Path(spec.origin).parent / "lib" / "libgomp.so.1"
    return candidate if candidate.is_file() else None


@cache
def load_library(path: Path = LIBRARY) -> tuple[ctypes.CDLL | None, str]:
    """``(the loaded library, "")`` or ``(None, why it is not usable)``; loaded once per path and process.

    Usable means: the file exists, a child process loaded it cleanly within ``QUANTREG_PROBE_TIMEOUT``
    (:func:`quantreg.native.load`: a constructor that blocks, aborts or crashes reaches the child, not
    this process), it exports :data:`ENTRY_POINTS`, and ``qr_abi_version()`` is :data:`ABI_VERSION`;
    only then is it loaded here. The reasons start ``"extension not built"`` (no file: no compiler at
    install, or the build failed, as ``BUILD_FAILED.txt`` says) or ``"extension does not load"``
    (anything else). Never raises.
    """
    try:
        if not path.is_file():
            failure = build_failure() if path == LIBRARY else None
            why = f"the build failed: {failure}" if failure is not None else f"no {path.name} in the package"
            return None, f"extension not built ({why})"
        openmp = _torch_openmp()
        if "torch" not in sys.modules and openmp is not None:  # see the module docstring: one OpenMP runtime
            ctypes.CDLL(str(openmp))
        lib, why = native.load(path, symbols=ENTRY_POINTS, abi=("qr_abi_version", ABI_VERSION),
                               preload=[openmp] if openmp is not None else [])
    except Exception as exc:  # pragma: no cover - native.load never raises; torch's own libgomp did not load
        return None, f"extension does not load ({type(exc).__name__}: {' '.join(str(exc).split())})"
    if lib is None:
        return None, f"extension does not load ({why})"
    lib.qr_abi_version.argtypes = []
    lib.qr_abi_version.restype = ctypes.c_int32
    return lib, ""


def kernel_available() -> tuple[bool, str]:
    """``(True, "kernel loaded: <file> (ABI <n>), ISA path <path>")`` or ``(False, "unavailable: <why>")``,
    ``<why>`` from :func:`load_library`."""
    try:
        lib, why = load_library(LIBRARY)
    except Exception as exc:  # pragma: no cover - load_library never raises; a probe must not either
        lib, why = None, f"extension does not load ({type(exc).__name__}: {exc})"
    if lib is None:
        return False, f"unavailable: {why}"
    return True, f"kernel loaded: {LIBRARY.name} (ABI {ABI_VERSION}), ISA path {isa_path()}"
