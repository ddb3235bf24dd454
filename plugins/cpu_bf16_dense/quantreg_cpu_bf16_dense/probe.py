"""The availability probe of ``cpu_bf16_dense_kernel``. Asked only when a chain reaches the method.

Is this distribution's own library here and of the ABI this package expects? Quick, side-effect
free, never raises, imports no torch and does not load the library (loading it before torch would
bring in a second OpenMP runtime): it reads the file and looks for the ELF magic and the ABI marker
string the library carries (``csrc/dense.cpp``'s ``qrb_abi_marker``). The method's constructor then
loads it and checks ``qrb_abi_version()`` where the dense seam contains a failure (lenient: vLLM's
method and one WARNING; strict: one line), never at the first forward.
"""

from __future__ import annotations

import os
from pathlib import Path

from quantreg.host import hardware_cpu_flags
from quantreg.installed import build_failure as recorded_build_failure

LIBRARY = Path(__file__).with_name("libquantreg_cpu_bf16_dense.so")
"""The kernel (a plain C library, loaded by kernel.py)."""
ABI_VERSION = 1
ABI_MARKER = f"quantreg-cpu-bf16-dense ABI {ABI_VERSION};".encode()
"""The bytes ``csrc/dense.cpp`` embeds (``qrb_abi_marker``): bump both with :data:`ABI_VERSION`."""
ISA_ENV = "QUANTREG_CPU_BF16_DENSE_ISA"
"""Forces the kernel's ISA path (``avx2`` | ``avx512``); named here, where no torch is imported."""
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
BUILD_FAILED = Path(__file__).with_name("BUILD_FAILED.txt")
"""Written by setup.py when the build failed: the one line it printed."""
_MAX_LIBRARY_BYTES = 64 << 20


def build_failure() -> str | None:
    """Why the build failed, as setup.py recorded it, or ``None`` (no record: built, or never tried)."""
    return recorded_build_failure(BUILD_FAILED)


def isa_path() -> str:
    """The path the kernel will take here, decided as :func:`quantreg_cpu_bf16_dense.kernel.isa` does."""
    forced = os.environ.get(ISA_ENV, "").strip().lower() == "avx2"
    if forced or not AVX512_FLAGS <= hardware_cpu_flags():
        return "avx2 (AVX2+FMA" + (f", forced by {ISA_ENV})" if forced else ")")
    return "avx512 (AVX-512 BF16 vdpbf16ps)"


def library_problem() -> str | None:
    """Why the library file is not this package's kernel (``None``: it is), without loading it."""
    try:
        if not LIBRARY.is_file():
            failure = build_failure()
            return f"the build failed: {failure}" if failure is not None else f"no {LIBRARY.name} in the package"
        size = LIBRARY.stat().st_size
        if size > _MAX_LIBRARY_BYTES:
            return f"{LIBRARY.name} is {size} bytes, not this kernel"
        data = LIBRARY.read_bytes()
    except OSError as exc:  # a broken package must not break resolution
        return f"{LIBRARY.name} unreadable ({type(exc).__name__}: {exc})"
    if not data.startswith(b"\x7fELF"):
        return f"{LIBRARY.name} is not a shared library (no ELF header)"
    if ABI_MARKER not in data:
        return f"{LIBRARY.name} is not of ABI version {ABI_VERSION} (this package's kernel.py expects it; rebuild)"
    return None


def kernel_available() -> tuple[bool, str]:
    """``(True, "kernel built: <file>, ISA path <path>")`` or
    ``(False, "unavailable: extension not built (<why>)")``."""
    problem = library_problem()
    if problem is not None:
        return False, f"unavailable: extension not built ({problem})"
    return True, f"kernel built: {LIBRARY.name}, ISA path {isa_path()}"
