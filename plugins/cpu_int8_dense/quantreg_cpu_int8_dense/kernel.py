"""The compiled int8 dense kernel: Python API over the plain C library ``libquantreg_cpu_int8_dense.so``.

``y = x W^T (+ b)`` for a dense layer whose bf16 weight ``W [N, K]`` was quantised once at load to
int8 per (output row, 32-block along K) with fp16 scales -- llama.cpp's Q8_0 layout
(:func:`.quantize.quantize_blocks`) -- and repacked into the kernel's 16-row interleave
(``csrc/int8_dense.h``); per call each token's activations are quantised to int8 per 32-block too
(``s = max|x| / 127`` per block, fp32), each block's dot product is exact in int32 and accumulated in
fp32 as ``float(dot) * wscale * s``, then ``+ b_n`` in the output dtype.

Why a C library loaded by :mod:`ctypes` and not a torch C++ extension: it builds with a bare C++
compiler at ``pip install`` (no torch at build time, no second torch in an isolated build) and one
built wheel loads under every torch (as plugin #2, quantreg-cpu-mxfp4). The forward is the
registered torch custom op ``quantreg_cpu_int8_dense::linear`` (:func:`torch.library.custom_op`
with a fake implementation giving the output's shape and dtype), so vLLM's compiled mode traces a
layer's call as one opaque op.

ISA paths (:func:`isa`, read on every call so tests switch paths in one process):
``QUANTREG_CPU_INT8_DENSE_ISA=avx2`` forces the baseline; unset or ``avx512`` takes AVX-512 VNNI
(``vpdpbusd``, u8 x s8 into int32) where the CPU has it (F/BW/VL/VNNI), else AVX2. The AVX2 path
does NOT saturate: ``vpmaddubsw(|w|, sign(q, w))`` with both operands within [-127, 127] keeps every
int16 pair sum within 2 x 127 x 127 = 32,258 (``csrc/gemv_avx2.cpp`` has the proof) -- unlike
oneDNN's int8 GEMM without VNNI, which feeds ``q + 128`` (up to 255) and clips (issue 46).

Numerics (:data:`NUMERICS`): the block dot products are exact in int32 on both paths and the fp32
accumulation runs the same lane operations in the same order, so the two paths agree to the last bit
(the tests hold them equal); the error against float64 is that of the two int8 roundings per 32-block
(weights and activations, as Q8_0), 0.3-1.1 % of the output's largest value on Gaussian data and, unlike
a per-token activation scale, not inflated by a few massive activation channels (issue 54).

Token counts: every token count runs the same kernel, tiled by up to 8 (AVX-512) or 4 (AVX2) tokens
per pass over a 16-row group whose 16 x K bytes stay in L1/L2 between tiles, so the weight is read
from memory once per call and the work is int8 dot products (measured in bench/dense_kernel_bench.py
against fp32 SGEMM and vLLM's oneDNN int8 GEMM at 512 tokens).

Threads: an OpenMP region of ``torch.get_num_threads()`` workers (static split of the 16-row groups)
in the libgomp torch already loaded (this module imports torch before loading the library).
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

from .plugin import KERNEL_NUMERICS
from .probe import ABI_VERSION, ISA_ENV, LIBRARY, build_failure
from .quantize import BLOCK, quantize_blocks

log = logging.getLogger("vllm.quantreg.cpu_int8_dense")

ROWS = 16
"""Rows per group of the interleave (``csrc/int8_dense.h`` kRows)."""
COL_ALIGN = BLOCK
MAX_K = 65536
"""Largest K taken (int32 sums are per 32-block, so any K would do; the bound keeps the activation buffer sane)."""
NUMERICS = KERNEL_NUMERICS
"""What the kernel rounds, per what block (the method's registration says the same: ``plugin.KERNEL_NUMERICS``)."""
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class _Args(ctypes.Structure):
    """``Args`` of ``csrc/dense.cpp``, field by field (the C ABI; :data:`ABI_VERSION` guards it)."""

    _fields_ = [
        ("x", ctypes.c_void_p), ("x_dtype", ctypes.c_int32), ("m", ctypes.c_int64), ("k", ctypes.c_int64),
        ("packed", ctypes.c_void_p), ("wscale", ctypes.c_void_p),
        ("n", ctypes.c_int64), ("kp", ctypes.c_int64),
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
        loaded, why = native.load(path, symbols=("qr8_cpu_supports", "qr8_pack", "qr8_linear"),
                                  abi=("qr8_abi_version", ABI_VERSION), preload=_openmp_loaded())
        if loaded is None:
            raise OSError(why)
        lib = loaded
        lib.qr8_cpu_supports.argtypes = [ctypes.c_char_p]
        lib.qr8_cpu_supports.restype = ctypes.c_int32
        lib.qr8_pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64]
        lib.qr8_pack.restype = ctypes.c_int32
        lib.qr8_linear.argtypes = [ctypes.POINTER(_Args), ctypes.c_char_p, ctypes.c_int64]
        lib.qr8_linear.restype = ctypes.c_int32
    except Exception as exc:  # OSError (not a library, missing symbols, wrong architecture), AttributeError
        why = f"{type(exc).__name__}: {exc}"
        log.debug("%s not loaded: %s", path.name, why)
        return None, why
    return lib, ""


def _library() -> ctypes.CDLL:
    lib, why = _extension()
    if lib is None:
        raise RuntimeError(f"quantreg_cpu_int8_dense's compiled kernel is not available (extension not built: {why})")
    return lib


def require() -> str:
    """Load the library and check it can run here (the method's constructor calls this, so a library
    that cannot load fails where the seam contains it); returns the ISA path it will take."""
    lib = _library()
    if not lib.qr8_cpu_supports(b"avx2"):
        raise RuntimeError("quantreg_cpu_int8_dense's kernel needs AVX2+FMA, which this CPU lacks")
    return isa()


def status() -> tuple[bool, str]:
    """``(True, "avx512" | "avx2")`` when the kernel can run (and which path it takes), else ``(False, why)``."""
    try:
        return True, require()
    except Exception as exc:
        return False, str(exc)


_warned: set[str] = set()


def isa() -> str:
    """The path :func:`linear` runs now: ``"avx512"`` or ``"avx2"`` (``QUANTREG_CPU_INT8_DENSE_ISA``, read per call)."""
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
    return "avx512" if lib is not None and lib.qr8_cpu_supports(b"avx512") else "avx2"




def _roundup(value: int, to: int) -> int:
    return (value + to - 1) // to * to


@dataclass(frozen=True)
class PackedWeight:
    """One dense weight in the kernel's layout, made once at load (:meth:`from_weight`).

    ``packed`` int8 ``[Np * Kp]`` (the 16-row interleave, zero padded: Np a multiple of 16, Kp of 32),
    ``scale`` fp16 ``[Np / 16 * Kp / 32 * 16]`` (per 16-row group and 32-block, the 16 rows' scales
    together; padding 0).
    """

    packed: torch.Tensor
    scale: torch.Tensor
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        """Bytes held: what a token's GEMV reads (the int8 weight with its padding and its block scales)."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale))

    @classmethod
    def from_int8(cls, q: torch.Tensor, scale: torch.Tensor) -> PackedWeight:
        """From int8 ``q [N, K]`` (values in [-127, 127]) and fp16 ``scale [N, ceil(K / 32)]`` (one per 32-block)."""
        if q.dim() != 2 or q.dtype != torch.int8 or q.device.type != "cpu":
            raise ValueError(f"expected a 2-D int8 CPU weight, got {tuple(q.shape)} {q.dtype} on {q.device}")
        n, k = int(q.shape[0]), int(q.shape[1])
        if not 0 < k <= MAX_K or n <= 0:
            raise ValueError(f"weight [{n}, {k}]: the kernel takes 1 <= K <= {MAX_K} and N >= 1")
        np_, kp = _roundup(n, ROWS), _roundup(k, COL_ALIGN)
        blocks = kp // BLOCK
        if tuple(scale.shape) != (n, blocks):
            raise ValueError(f"scale has shape {tuple(scale.shape)}, expected ({n}, {blocks}): one per 32-block")
        lib = _library()
        packed = torch.empty(np_ * kp, dtype=torch.int8)
        pscale = torch.empty(np_ * blocks, dtype=torch.float16)
        q = q.contiguous()
        scale = scale.to(torch.float16).contiguous()
        err = ctypes.create_string_buffer(256)
        if lib.qr8_pack(q.data_ptr(), scale.data_ptr(), n, k, kp, packed.data_ptr(), pscale.data_ptr(), err,
                        len(err)) != 0:
            raise ValueError(f"quantreg_cpu_int8_dense: {err.value.decode(errors='replace')}")
        return cls(packed, pscale, n, k)

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> PackedWeight:
        """Quantise a floating-point ``[N, K]`` weight per (row, 32-block) and repack it."""
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"expected a 2-D floating-point weight, got {tuple(weight.shape)} {weight.dtype}")
        q, scale = quantize_blocks(weight.detach())
        return cls.from_int8(q, scale)


def _forward(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, n: int,
             k: int) -> torch.Tensor:
    """The op's CPU implementation: checks what the C side cannot, hands over pointers."""
    if x.device.type != "cpu" or x.shape[-1] != k:
        raise ValueError(f"x must be a CPU tensor [..., {k}], got {list(x.shape)} on {x.device}")
    kp = _roundup(k, COL_ALIGN)
    if packed.numel() != _roundup(n, ROWS) * kp or packed.dtype != torch.int8:
        raise ValueError(f"packed weight of {packed.numel()} {packed.dtype} does not hold [{n}, {k}]")
    if scale.numel() != _roundup(n, ROWS) * kp // BLOCK or scale.dtype != torch.float16:
        raise ValueError(f"block scales of {scale.numel()} {scale.dtype} do not fit [{n}, {k}]")
    lib = _library()
    shape = x.shape
    out_dtype = x.dtype
    x2 = x.reshape(-1, k)
    if x2.dtype not in _DTYPES:
        x2 = x2.float()
    x2 = x2.contiguous()
    m = int(x2.shape[0])
    out = torch.empty((m, n), dtype=x2.dtype)
    if bias is not None:
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({n},)")
        if bias.dtype not in _DTYPES:
            bias = bias.float()
        bias = bias.contiguous()
    args = _Args(x=x2.data_ptr(), x_dtype=_DTYPES[x2.dtype], m=m, k=k, packed=packed.data_ptr(),
                 wscale=scale.data_ptr(), n=n, kp=kp,
                 bias=None if bias is None else bias.data_ptr(), bias_dtype=0 if bias is None else _DTYPES[bias.dtype],
                 out=out.data_ptr(), out_dtype=_DTYPES[out.dtype], isa=1 if isa() == "avx512" else 0,
                 threads=torch.get_num_threads())
    err = ctypes.create_string_buffer(256)
    if lib.qr8_linear(ctypes.byref(args), err, len(err)) != 0:
        raise RuntimeError(f"quantreg_cpu_int8_dense: {err.value.decode(errors='replace')}")
    return out.to(out_dtype).reshape(*shape[:-1], n)


_linear_op = torch.library.custom_op(
    "quantreg_cpu_int8_dense::linear", _forward, mutates_args=(), device_types="cpu",
    schema="(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int n, int k) -> Tensor")


def _fake(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, n: int,
          k: int) -> torch.Tensor:
    """The output's shape and dtype, for tracing (``torch.compile``, vLLM's compiled mode)."""
    return x.new_empty((*x.shape[:-1], n))


_linear_op.register_fake(_fake)


def linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ bias)``: ``x [..., K]`` (bf16, fp32 or fp16), out ``[..., N]`` in ``x``'s dtype.

    Through the registered op ``torch.ops.quantreg_cpu_int8_dense.linear`` (one opaque call for
    ``torch.compile``). Raises ``RuntimeError`` if the extension is not built.
    """
    out: torch.Tensor = torch.ops.quantreg_cpu_int8_dense.linear(x, weight.packed, weight.scale, bias, weight.n,
                                                                 weight.k)
    return out
