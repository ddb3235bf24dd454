"""The compiled bf16 dense kernel: Python API over the plain C library ``libquantreg_cpu_bf16_dense.so``.

``y = x W^T (+ b)`` for a dense layer's bf16 weight ``W [N, K]``, repacked once at load into the
kernel's 16-row pair interleave (``csrc/bf16_dense.h``) -- no lossy step anywhere: bf16 -> fp32 is
a 16-bit shift, a product of two bf16 values is exact in fp32, sums are fp32, and the output is
rounded to bf16 once (after the bias). So the result is the faithful path's (vLLM's own bf16
layer: oneDNN or torch, fp32 accumulation) up to the order of the fp32 additions.

Why a C library loaded by :mod:`ctypes` and not a torch C++ extension: it builds with a bare C++
compiler at ``pip install`` (no torch at build time) and one built wheel loads under every torch.
The forward is the registered torch custom op ``quantreg_cpu_bf16_dense::linear`` (with a fake
implementation giving the output's shape and dtype), so vLLM's compiled mode traces a layer's call
as one opaque op.

One kernel for every token count (``csrc/dense.cpp``): output rows in chunks of 64 taken
by ``torch.get_num_threads()`` OpenMP workers as they come, in one parallel region (no barrier
inside, dynamic: on a shared host a descheduled thread leaves its share to the one that runs); per chunk, blocks of 32
tokens whose activations stay in L2 beside it, and tiles of up to 8 tokens (AVX-512) or 4 (AVX2)
per pass over a 16-row group. At 1-8 tokens that is a GEMV reading the weight once;
at 512 it is a blocked GEMM (measured against torch's fp32 SGEMM in bench/bf16_dense_bench.py).

ISA paths (:func:`isa`, read per call): ``QUANTREG_CPU_BF16_DENSE_ISA=avx2`` forces AVX2+FMA (shift
to fp32, FMA); unset or ``avx512`` takes AVX-512 BF16 (``vdpbf16ps``) where the CPU has
F/BW/VL/BF16 (an fp32 activation takes the AVX2 tile: vdpbf16ps multiplies bf16 by bf16). Both add
in the same order (``bf16_dense.h``), so they give the same bits except where vdpbf16ps flushes a
denormal to zero (``gemv_avx512.cpp``).
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

import quantreg.native as native

from .probe import ABI_VERSION, ISA_ENV, LIBRARY, build_failure

log = logging.getLogger("vllm.quantreg.cpu_bf16_dense")

ROWS = 16
"""Rows per group of the interleave (``csrc/bf16_dense.h`` kRows)."""
COL_ALIGN = 8
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class _Args(ctypes.Structure):
    """``Args`` of ``csrc/dense.cpp``, field by field (the C ABI; :data:`ABI_VERSION` guards it)."""

    _fields_ = [
        ("x", ctypes.c_void_p), ("x_dtype", ctypes.c_int32), ("m", ctypes.c_int64), ("k", ctypes.c_int64),
        ("packed", ctypes.c_void_p), ("n", ctypes.c_int64), ("kp", ctypes.c_int64),
        ("bias", ctypes.c_void_p), ("bias_dtype", ctypes.c_int32),
        ("out", ctypes.c_void_p), ("out_dtype", ctypes.c_int32),
        ("isa", ctypes.c_int32), ("threads", ctypes.c_int32),
    ]


def _openmp_loaded() -> list[Path]:
    """torch's own ``libgomp.so.1`` (pip wheels), which this process already holds: the checking child
    loads it first too, so the library resolves its OpenMP dependency there as it will here."""
    candidate = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    return [candidate] if candidate.is_file() else []


@cache
def _extension() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded C library or None, why not). Loaded after ``import torch`` (above), so its
    ``libgomp.so.1`` is the one torch already loaded."""
    path = Path(LIBRARY)
    if not path.is_file():
        failure = build_failure()
        return None, f"the build failed: {failure}" if failure is not None else f"no {path.name} in the package"
    try:
        # a child process loads it first (quantreg.native): a constructor that blocks, aborts or crashes
        # fails this method's construction, where the seam contains it, instead of taking vLLM down
        loaded, why = native.load(path, symbols=("qrb_cpu_supports", "qrb_pack", "qrb_unpack", "qrb_linear"),
                                  abi=("qrb_abi_version", ABI_VERSION), preload=_openmp_loaded())
        if loaded is None:
            raise OSError(why)
        lib = loaded
        lib.qrb_cpu_supports.argtypes = [ctypes.c_char_p]
        lib.qrb_cpu_supports.restype = ctypes.c_int32
        lib.qrb_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_int32, ctypes.c_char_p, ctypes.c_int64]
        lib.qrb_pack.restype = ctypes.c_int32
        lib.qrb_unpack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32, ctypes.c_char_p, ctypes.c_int64]
        lib.qrb_unpack.restype = ctypes.c_int32
        lib.qrb_linear.argtypes = [ctypes.POINTER(_Args), ctypes.c_char_p, ctypes.c_int64]
        lib.qrb_linear.restype = ctypes.c_int32
    except Exception as exc:  # OSError (not a library, missing symbols, wrong architecture), AttributeError
        why = f"{type(exc).__name__}: {exc}"
        log.debug("%s not loaded: %s", path.name, why)
        return None, why
    return lib, ""


def _library() -> ctypes.CDLL:
    lib, why = _extension()
    if lib is None:
        raise RuntimeError(f"quantreg_cpu_bf16_dense's compiled kernel is not available (extension not built: {why})")
    return lib


def require() -> str:
    """Load the library and check it can run here (the method's constructor calls this, so a library
    that cannot load fails where the seam contains it); returns the ISA path it will take."""
    lib = _library()
    if not lib.qrb_cpu_supports(b"avx2"):
        raise RuntimeError("quantreg_cpu_bf16_dense's kernel needs AVX2+FMA, which this CPU lacks")
    return isa()


def status() -> tuple[bool, str]:
    """``(True, "avx512" | "avx2")`` when the kernel can run (and which path it takes), else ``(False, why)``."""
    try:
        return True, require()
    except Exception as exc:
        return False, str(exc)


_warned: set[str] = set()


def isa() -> str:
    """The GEMV path now: ``"avx512"`` or ``"avx2"`` (``QUANTREG_CPU_BF16_DENSE_ISA``, read per call)."""
    wanted = os.environ.get(ISA_ENV, "").strip().lower()
    if wanted not in ("", "avx2", "avx512"):
        message = f"{ISA_ENV}={wanted!r} is not 'avx2' or 'avx512'; ignoring it"
        if message not in _warned:
            _warned.add(message)
            log.warning("%s", message)
        wanted = ""
    if wanted == "avx2":
        return "avx2"
    lib, _ = _extension()
    return "avx512" if lib is not None and lib.qrb_cpu_supports(b"avx512") else "avx2"


def _roundup(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def _error(err: ctypes.Array[ctypes.c_char]) -> str:
    return f"quantreg_cpu_bf16_dense: {err.value.decode(errors='replace')}"


@dataclass(frozen=True)
class PackedWeight:
    """One bf16 dense weight in the kernel's layout, made once at load (:meth:`from_weight`):
    ``packed`` bf16 bits as int16 ``[Np * Kp]`` (Np a multiple of 16, Kp of 8, zero padded)."""

    packed: torch.Tensor
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        """Bytes held: what a token's GEMV reads (the bf16 weight with its padding)."""
        return int(self.packed.numel() * self.packed.element_size())

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> PackedWeight:
        """Repack a bf16 ``[N, K]`` CPU weight (bits copied, nothing rounded)."""
        if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError(f"expected a 2-D bf16 CPU weight, got {tuple(weight.shape)} {weight.dtype} "
                             f"on {weight.device}")
        n, k = int(weight.shape[0]), int(weight.shape[1])
        if n <= 0 or k <= 0:
            raise ValueError(f"weight [{n}, {k}]: the kernel takes N, K >= 1")
        lib = _library()
        kp = _roundup(k, COL_ALIGN)
        packed = torch.empty(_roundup(n, ROWS) * kp, dtype=torch.int16)
        w = weight.detach().contiguous()
        err = ctypes.create_string_buffer(256)
        if lib.qrb_pack(w.data_ptr(), n, k, kp, packed.data_ptr(), torch.get_num_threads(), err, len(err)) != 0:
            raise ValueError(_error(err))
        return cls(packed, n, k)

    def unpack(self) -> torch.Tensor:
        """The fp32 weight ``[N, K]`` back (exact; for tests and tools)."""
        return _panel(self.packed, self.n, self.k, 0, self.n, torch.empty(self.n, self.k))


def _panel(packed: torch.Tensor, n: int, k: int, row0: int, rows: int, buf: torch.Tensor) -> torch.Tensor:
    err = ctypes.create_string_buffer(256)
    if _library().qrb_unpack(packed.data_ptr(), n, k, _roundup(k, COL_ALIGN), row0, rows, buf.data_ptr(),
                             torch.get_num_threads(), err, len(err)) != 0:
        raise RuntimeError(_error(err))
    return buf[:rows]


def _forward(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, k: int) -> torch.Tensor:
    """The op's CPU implementation: checks what the C side cannot, hands over pointers."""
    if x.device.type != "cpu" or x.shape[-1] != k:
        raise ValueError(f"x must be a CPU tensor [..., {k}], got {list(x.shape)} on {x.device}")
    kp = _roundup(k, COL_ALIGN)
    if packed.numel() != _roundup(n, ROWS) * kp or packed.dtype != torch.int16:
        raise ValueError(f"packed weight of {packed.numel()} {packed.dtype} does not hold [{n}, {k}]")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({n},)")
    shape, out_dtype = x.shape, x.dtype
    x2 = x.reshape(-1, k)
    if x2.dtype not in _DTYPES:
        x2 = x2.float()
    x2 = x2.contiguous()
    m = int(x2.shape[0])
    out = torch.empty((m, n), dtype=x2.dtype)
    if bias is not None:
        bias = (bias if bias.dtype in _DTYPES else bias.float()).contiguous()
    args = _Args(x=x2.data_ptr(), x_dtype=_DTYPES[x2.dtype], m=m, k=k, packed=packed.data_ptr(), n=n, kp=kp,
                 bias=None if bias is None else bias.data_ptr(), bias_dtype=0 if bias is None else _DTYPES[bias.dtype],
                 out=out.data_ptr(), out_dtype=_DTYPES[out.dtype], isa=1 if isa() == "avx512" else 0,
                 threads=torch.get_num_threads())
    err = ctypes.create_string_buffer(256)
    if _library().qrb_linear(ctypes.byref(args), err, len(err)) != 0:
        raise RuntimeError(_error(err))
    return out.to(out_dtype).reshape(*shape[:-1], n)


_linear_op = torch.library.custom_op(
    "quantreg_cpu_bf16_dense::linear", _forward, mutates_args=(), device_types="cpu",
    schema="(Tensor x, Tensor packed, Tensor? bias, int n, int k) -> Tensor")


def _fake(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, k: int) -> torch.Tensor:
    """The output's shape and dtype, for tracing (``torch.compile``, vLLM's compiled mode)."""
    return x.new_empty((*x.shape[:-1], n))


_linear_op.register_fake(_fake)


def linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ bias)``: ``x [..., K]`` (bf16, fp32 or fp16), out ``[..., N]`` in ``x``'s dtype.

    Through the registered op ``torch.ops.quantreg_cpu_bf16_dense.linear`` (one opaque call for
    ``torch.compile``). Raises ``RuntimeError`` if the extension is not built.
    """
    out: torch.Tensor = torch.ops.quantreg_cpu_bf16_dense.linear(x, weight.packed, bias, weight.n, weight.k)
    return out
