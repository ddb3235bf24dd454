"""The compiled CPU MXFP4 MoE kernel: Python API over the plain C library ``libquantreg_cpu_mxfp4.so``.

Why a C library loaded by :mod:`ctypes` and not a torch C++ extension: an extension is tied to the
torch (and its C++ ABI) it was compiled against -- a wheel built under torch 2.13 does not load
under 2.14 -- and building one needs torch at build time, which pip's isolated build would
download a second time. ``csrc/`` includes no torch header and links no torch library: it builds
with a bare C++ compiler, and one built wheel runs under every torch. This module checks shapes,
dtypes and devices, passes ``data_ptr()``s and sizes (:class:`_MoeArgs`), and does the one step
that wants torch's GEMM -- the prefill path's bf16 matmul -- in a callback (:class:`_Gemm`; Python's
signal handlers wait while C may call it, :func:`_signals_held`, so Ctrl-C is never lost in it). The
whole forward -- library load, settings, checks, the C call -- is the torch custom op
``quantreg_cpu_mxfp4::moe_forward`` (``torch.library.custom_op`` with a fake implementation giving
the output's shape and dtype), so a model traced or compiled by ``torch.compile`` (vLLM's default
mode: Dynamo, ``fullgraph``) records one opaque call; :func:`moe_forward` around it does only
tensor work Dynamo can trace.

What runs (C++, ``csrc/``; OpenMP threads, as many as ``torch.get_num_threads()``, in the same
libgomp torch loaded): the routed
(token, expert) pairs are grouped per expert; each token's activations are quantised to int8 per
32-block (Q8_0: one fp32 scale per block, ``d = max|x| / 127``); then, for the routed experts only,
a fused MXFP4-dequant + GEMV reads each expert's packed bytes once: E2M1 codes become int8 through
a 16-entry table of doubled values (``vpshufb``), int8 dot products (AVX-512 VNNI ``vpdpbusd`` or
AVX2 ``vpmaddubsw``/``vpmaddwd``) per 32-block, one vector lane per output row (16 rows side by
side, see "Weight layout"), then one fp32 FMA per block with ``2^(e-127) * d / 2``. Bias,
activation (SwiGLU-OAI or SiLU) and a second Q8 quantisation of the activation follow, then the w2
GEMV and the routing-weighted sum per token. Several tokens per expert use the same kernel with
each 32-block of 16 rows decoded once and reused over tiles of 8 (AVX-512) or 2 (AVX2) tokens.

Numerics -- what activation quantisation costs, and why there is a residual. The MXFP4 weights
are used exactly (the int8 table holds 2x every E2M1 value). The approximation is rounding
activations to int8 per 32 values, twice (``x`` before w13, the activation before w2). Plain Q8
(a rule's ``precision: q8``, or ``QUANTREG_CPU_MXFP4_PRECISION=q8`` as the process default) has a
per-element error of up to ``max|block| / 254``; a
block holding one large value (GPT-OSS's SwiGLU clamps produce them: ``(up + 1) * 7``) rounds
every other element of the block coarsely. Measured against float64 on random GPT-OSS-like experts
(``relative_error``: max abs error / max abs reference): 0.8-1.0 % per quantisation at H=I=2880,
1.1-1.3 % for both, and up to 1.9 % on small experts with clamped rows -- inside the project's 2 %
tolerance, outside its 1 % aim. So the default, ``q8x2``, also quantises the residual
``x - dequant(Q8(x))`` to a second int8 row and runs both through the same GEMV (the weights are
decoded once per token tile, so no extra weight traffic; the dot-product work doubles): the error
becomes ~1/254 of Q8's and what remains is fp32 accumulation and the final rounding to ``x``'s
dtype (bf16: 0.4 % of an element, ~0.3 % ``relative_error``). The tests hold both settings to
the 2 % tolerance and ``q8x2`` to 1 %. Cost (shared 2-core AVX-512 host, 16-row kernel): +10-25 %
over ``q8`` at 1 token (2.4-2.9 ms against 2.1-2.3 ms, interleaved: ``q8`` is then at the read
floor, ``q8x2`` is bound by its doubled dot products), more at several tokens per expert
(compute-bound), which is why ``q8x2`` hands experts to the GEMM prefill path from 128 tokens and
``q8`` only from 1024 (:data:`GEMM_MIN_TOKENS`); ``q8`` stays the faster setting for long prompts on
hosts without AMX. (Measured 2026-12-06 with fp32 outputs: ``q8x2``'s own error is ~4e-5
``relative_error``; what the tests see is the bf16 rounding of the output.)

Format edge cases: E8M0 byte 255 (NaN in the OCP spec) yields non-finite outputs for the rows
that use it; byte 0 (2^-127) is treated as 0 (a difference below 1e-38 relative). Non-finite
activations make their block's outputs NaN.

ISA choice: :func:`isa` reads ``QUANTREG_CPU_MXFP4_ISA`` on **every call** (so tests can switch
paths in one process): ``avx2`` forces the baseline; ``avx512`` (or unset) asks for AVX-512
(F/BW/VL/VNNI) and falls back to AVX2 where the CPU lacks it. AMX is never required.

Weight layout: :class:`PackedExperts` (:mod:`.packed`) repacks vLLM's row-major experts once at load
into the 16-row interleave the kernel streams (``csrc/gemv.h``).

Prefill: the int8 kernel is compute-bound at many tokens per expert (weights decoded once per
16-row x 32-column block and reused over 8 (AVX-512) or 2 (AVX2) tokens). So an expert with at
least :data:`GEMM_MIN_TOKENS` routed tokens takes another path inside the same op: tile by tile
(:data:`GEMM_ROWS` rows of one expert, decoded in parallel by 16-row groups) its weights are decoded
exactly -- every MXFP4 value is a bf16 and an fp32 -- into a K-major scratch tile freed after the
forward (weights stay packed, resident memory unchanged), and ``torch.mm`` (called back from the
C library) multiplies the expert's tokens by it: W13, then the activation, then W2; weighting and
the per-token sum are shared with the int8 path. The GEMM's dtype follows the CPU: bf16 where the
avx512 path runs on a CPU with AVX-512 BF16 (oneDNN: AVX-512 BF16, AMX where present; error that
of a torch bf16 MoE on the dequantised weights, ``mxfp4_reference``'s scheme: 0.5-0.7 %
measured), fp32 elsewhere (AVX2 hosts, and the forced avx2 path: torch's bf16 GEMM is emulated
there, 21 against its fp32 132 GFLOP/s on an AVX2 EPYC, issue 44; error that of fp32 accumulation,
~2e-6 before the output's rounding to bf16).

Threads: every stage runs on ``torch.get_num_threads()`` OpenMP threads; GEMV jobs are
(expert, 256-row block) pairs taken from a shared counter, so uneven experts balance.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from functools import cache
from pathlib import Path
from typing import Any

import torch

# the prefill callback and the weight layout, each in its own module, named here as before
from .callback import _GEMM_FN, _Gemm, _signals_held
from .callback import GEMM_DONE as GEMM_DONE
from .callback import HELD_SIGNALS as HELD_SIGNALS
from .options import PRECISIONS as PRECISIONS
from .packed import BLOCK_SIZE as BLOCK_SIZE
from .packed import PackedExperts as PackedExperts

# the setting's and the ABI's one home: the probe (no torch) reads them too, and loads the library
from .probe import ABI_VERSION as ABI_VERSION
from .probe import ISA_ENV, load_library

log = logging.getLogger("vllm.quantreg.cpu_mxfp4")

PRECISION_ENV = "QUANTREG_CPU_MXFP4_PRECISION"
ACTIVATIONS = ("swigluoai", "silu")
# Tokens routed to one expert from which it takes the prefill path (decoded tiles + torch.mm)
# instead of the Q8 GEMV, per activation precision. The int8 GEMV stays compute-efficient at many
# tokens (weights decoded once per 16-row block and reused over a tile of tokens) and its dynamic
# job split keeps both threads busy on a shared machine, where torch's GEMM loses more to a
# descheduled thread. Measured 2026-12-06 (AMD EPYC Zen 4, AVX-512 BF16, no AMX; GPT-OSS-20B layer,
# one thread, CPU time, 32 experts x c tokens; load 7-9): at c=32 GEMV 449 ms (avx512) / 899 ms
# (avx2) against the GEMM path's 580-640 ms (bf16 tiles) / 1,250-1,330 ms (fp32 tiles); at c=128
# GEMV 1.94 s / 4.3 s against 1.95-3.8 s / 3.7-3.9 s: the crossover is near 128 tokens under
# q8x2 on both routes, and later under q8 (half the dot products). (The earlier bf16 row-major
# decode measured a crossover of 48 on this host: the GEMV has since become cheaper.)
# q8 re-measured on a quiet host (2026-12-06, same kind, both threads, wall clock, whole layer, q8's
# GEMV against the GEMM path): at 256 tokens per expert 913 against 1,382 ms (avx512) and 2.0 against
# 2.6 s (avx2 forced); at 512, 2.0 against 3.6 s (avx512). No crossover by 512, so q8 keeps the GEMV
# to 1024 (a vLLM server's prefill chunk of 2,048-8,192 tokens routes 256-1,024 to each expert; served
# at 16 clients the change moved TTFT only 112 -> 107 s, one run each). q8x2 is at its crossover there (1.75 against
# 1.88 s at 256, 3.6 against 3.8 s at 512: the GEMM path a little faster) and keeps 128. AMX hosts
# (oneDNN's bf16 GEMM on AMX tiles) are not re-measured: there the chain serves vLLM's kernel first.
GEMM_MIN_TOKENS = {"q8x2": 128, "q8": 1024}
# Rows of one expert decoded per prefill GEMM call: 512 x 2880 is 2.9 MiB in bf16, 5.9 MiB in fp32
# (stays in the LLC between its decode and the matmul that reads it), 12 / 6 calls per GPT-OSS expert.
GEMM_ROWS = 512
LIBRARY = "libquantreg_cpu_mxfp4.so"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class _MoeArgs(ctypes.Structure):
    """``QrMoeArgs`` of ``csrc/moe.cpp``, field by field (the C ABI; :data:`ABI_VERSION` guards it)."""

    _fields_ = [
        ("x", ctypes.c_void_p), ("x_dtype", ctypes.c_int32), ("t", ctypes.c_int64), ("h", ctypes.c_int64),
        ("topk_ids", ctypes.c_void_p), ("ids_bits", ctypes.c_int32), ("topk", ctypes.c_int64),
        ("topk_weights", ctypes.c_void_p),
        ("w13_blocks", ctypes.c_void_p), ("w13_scales", ctypes.c_void_p),
        ("w13_bias", ctypes.c_void_p), ("w13_bias_dtype", ctypes.c_int32),
        ("w2_blocks", ctypes.c_void_p), ("w2_scales", ctypes.c_void_p),
        ("w2_bias", ctypes.c_void_p), ("w2_bias_dtype", ctypes.c_int32),
        ("e", ctypes.c_int64), ("i", ctypes.c_int64),
        ("activation", ctypes.c_int32), ("alpha", ctypes.c_float), ("limit", ctypes.c_float),
        ("isa", ctypes.c_int32), ("per", ctypes.c_int32),
        ("gemm_min_tokens", ctypes.c_int64), ("gemm_rows", ctypes.c_int64), ("threads", ctypes.c_int32),
        ("out", ctypes.c_void_p), ("gemm", _GEMM_FN),
    ]


@cache
def _extension() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded C library or None, why not): :func:`.probe.load_library` (the probe's one loader:
    file, entry points, ABI version), then the argument types of the calls made here. Loaded after
    ``import torch`` (above), so its ``libgomp.so.1`` is the one torch already loaded."""
    lib, why = load_library(Path(__file__).with_name(LIBRARY))
    if lib is None:
        log.debug("%s not loaded: %s", LIBRARY, why)
        return None, why
    lib.qr_cpu_supports.argtypes = [ctypes.c_char_p]
    lib.qr_cpu_supports.restype = ctypes.c_int32
    lib.qr_moe_forward.argtypes = [ctypes.POINTER(_MoeArgs), ctypes.c_char_p, ctypes.c_int64]
    lib.qr_moe_forward.restype = ctypes.c_int32
    return lib, ""


def _supports(isa_name: str) -> bool:
    lib, _ = _extension()
    return bool(lib is not None and lib.qr_cpu_supports(isa_name.encode()))


def status() -> tuple[bool, str]:
    """``(True, "avx512" | "avx2")``: the kernel can run and this path would; else ``(False, why)``.

    Never raises: a fallback chain asks this first. The reasons are ``"extension not built (...)"``
    (the build had no compiler or failed), ``"extension does not load (...)"`` (not a library,
    another ABI version, missing entry points: :func:`.probe.load_library`) and
    ``"CPU lacks avx2+fma"``.
    """
    try:
        module, why = _extension()
        if module is None:
            return False, why
        if not _supports("avx2"):
            return False, "CPU lacks avx2+fma"
        return True, isa()
    except Exception as exc:  # pragma: no cover - defensive: status() must never raise
        return False, f"extension not usable: {type(exc).__name__}: {exc}"


def require() -> None:
    """Raise ``RuntimeError`` naming why unless the kernel can run here: what the method's
    constructor calls, so a method that is built can run its first forward (the seam contains a
    failure at build -- lenient: vLLM's own method; strict: one line -- but not one at the first
    forward)."""
    ok, why = status()
    if not ok:
        raise RuntimeError(f"cpu_mxfp4 cannot run in this process: {why}")


def precision() -> str:
    """The process default activation quantisation, read per call from ``QUANTREG_CPU_MXFP4_PRECISION``:
    "q8x2" (default) or "q8". A rule's ``precision`` option, passed down by the method, takes precedence."""
    wanted = os.environ.get(PRECISION_ENV, "").strip().lower() or PRECISIONS[0]
    if wanted not in PRECISIONS:
        _warn_once(f"{PRECISION_ENV}={wanted!r} is not one of {PRECISIONS}; using {PRECISIONS[0]}")
        return PRECISIONS[0]
    return wanted


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """One WARNING per distinct bad setting and process: both settings are read on every forward
    (of every layer), and a bad value used to repeat its warning at every decode step."""
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def isa() -> str:
    """The path :func:`moe_forward` will run now: ``"avx512"`` or ``"avx2"`` (read per call)."""
    wanted = os.environ.get(ISA_ENV, "").strip().lower()
    if wanted not in ("", "avx2", "avx512"):
        _warn_once(f"{ISA_ENV}={wanted!r} is not 'avx2' or 'avx512'; ignoring it")
        wanted = ""
    if wanted == "avx2":
        return "avx2"
    return "avx512" if _supports("avx512") else "avx2"


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(f"quantreg_cpu_mxfp4: {message}")


def _check_stack(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> tuple[int, int, int]:
    _check(blocks.device.type == "cpu" and scales.device.type == "cpu", f"{name} must be on the CPU")
    _check(blocks.dtype == torch.uint8 and scales.dtype == torch.uint8,
           f"{name} blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    _check(blocks.dim() == 3 and scales.dim() == 3, f"{name} blocks must be [E, N, K/2] and scales [E, N, K/32], "
           f"got {list(blocks.shape)} and {list(scales.shape)}")
    _check(blocks.is_contiguous() and scales.is_contiguous(), f"{name} blocks and scales must be contiguous")
    e, n, k = int(blocks.shape[0]), int(blocks.shape[1]), int(blocks.shape[2]) * 2
    _check(k > 0 and k % BLOCK_SIZE == 0, f"{name} K = {k} must be a positive multiple of {BLOCK_SIZE}")
    _check(tuple(scales.shape) == (e, n, k // BLOCK_SIZE), f"{name} scales {list(scales.shape)} do not match "
           f"blocks {list(blocks.shape)} (expected [{e}, {n}, {k // BLOCK_SIZE}])")
    return e, n, k


def _check_float(t: torch.Tensor, name: str) -> None:
    _check(t.dtype in _DTYPES, f"{name} must be bfloat16, float16 or float32, got {t.dtype}")


def _check_bias(bias: torch.Tensor | None, e: int, n: int, name: str) -> None:
    if bias is None:
        return
    _check_float(bias, name)
    _check(bias.device.type == "cpu" and bias.is_contiguous(), f"{name} must be a contiguous CPU tensor")
    _check(tuple(bias.shape) == (e, n), f"{name} must be [{e}, {n}], got {list(bias.shape)}")


def _forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
             w13_scale: torch.Tensor, w13_bias: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor,
             w2_bias: torch.Tensor | None, activation: str, alpha: float, limit: float, isa_name: str,
             precision_name: str, gemm_min_tokens: int) -> torch.Tensor:
    """The op's CPU implementation: checks (the messages the extension gave), then one C call."""
    lib, why = _extension()
    if lib is None:
        raise RuntimeError(f"quantreg_cpu_mxfp4's compiled kernel is not available (extension not built: {why})")
    _check(precision_name in PRECISIONS, f"precision must be 'q8' or 'q8x2', got '{precision_name}'")
    _check(activation in ACTIVATIONS, f"activation must be 'swigluoai' or 'silu', got '{activation}'")
    _check(isa_name in ("avx2", "avx512"), f"unknown ISA '{isa_name}' (expected 'avx2' or 'avx512')")
    _check(_supports(isa_name), f"this CPU does not support the '{isa_name}' path")
    _check(x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous(),
           f"x must be a contiguous CPU tensor [T, H], got {list(x.shape)}")
    _check_float(x, "x")
    _check(topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0] and topk_ids.is_contiguous()
           and topk_ids.dtype in (torch.int32, torch.int64) and topk_ids.device.type == "cpu",
           f"topk_ids must be contiguous int32/int64 [T, k] with T = {x.shape[0]}, got {topk_ids.dtype} "
           f"{list(topk_ids.shape)}")
    _check(topk_weights.shape == topk_ids.shape,
           f"topk_weights {list(topk_weights.shape)} must match topk_ids {list(topk_ids.shape)}")
    _check_float(topk_weights, "topk_weights")
    e, n13, k13 = _check_stack(w13, w13_scale, "w13")
    e2, n2, k2 = _check_stack(w2, w2_scale, "w2")
    t, h = int(x.shape[0]), int(x.shape[1])
    _check(e2 == e, f"w13 has {e} experts, w2 {e2}")
    _check(k13 == h, f"w13 K = {k13} must equal x's hidden size {h}")
    _check(n13 % 2 == 0 and n13 // 2 == k2, f"w13 rows ({n13}) must be 2 x w2's K ({k2})")
    _check(n2 == h, f"w2 rows ({n2}) must equal the hidden size {h}")
    _check_bias(w13_bias, e, n13, "w13_bias")
    _check_bias(w2_bias, e, n2, "w2_bias")
    out = torch.empty_like(x)
    weights = topk_weights.to(device="cpu", dtype=torch.float32).contiguous()
    gemm = _Gemm()
    args = _MoeArgs(
        x=x.data_ptr(), x_dtype=_DTYPES[x.dtype], t=t, h=h,
        topk_ids=topk_ids.data_ptr(), ids_bits=32 if topk_ids.dtype == torch.int32 else 64,
        topk=int(topk_ids.shape[1]), topk_weights=weights.data_ptr(),
        w13_blocks=w13.data_ptr(), w13_scales=w13_scale.data_ptr(),
        w13_bias=None if w13_bias is None else w13_bias.data_ptr(),
        w13_bias_dtype=0 if w13_bias is None else _DTYPES[w13_bias.dtype],
        w2_blocks=w2.data_ptr(), w2_scales=w2_scale.data_ptr(),
        w2_bias=None if w2_bias is None else w2_bias.data_ptr(),
        w2_bias_dtype=0 if w2_bias is None else _DTYPES[w2_bias.dtype],
        e=e, i=k2, activation=ACTIVATIONS.index(activation), alpha=alpha, limit=limit,
        isa=1 if isa_name == "avx512" else 0, per=2 if precision_name == "q8x2" else 1,
        gemm_min_tokens=gemm_min_tokens, gemm_rows=GEMM_ROWS, threads=torch.get_num_threads(),
        out=out.data_ptr(), gemm=gemm.fn)
    err = ctypes.create_string_buffer(512)
    # a callback is possible only if some expert can get gemm_min_tokens routed tokens: decode never
    may_call_back = 0 < gemm_min_tokens <= t * int(topk_ids.shape[1])
    with _signals_held() if may_call_back else contextlib.nullcontext():
        failed = lib.qr_moe_forward(ctypes.byref(args), err, len(err)) != 0
    if failed:
        if gemm.error is not None:
            raise gemm.error
        raise RuntimeError(f"quantreg_cpu_mxfp4: {err.value.decode(errors='replace')}")
    return out


def _moe_forward_impl(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                      w13_scale: torch.Tensor, w13_bias: torch.Tensor | None, w2: torch.Tensor,
                      w2_scale: torch.Tensor, w2_bias: torch.Tensor | None, activation: str, alpha: float,
                      limit: float, gemm_min_tokens: int, precision_name: str) -> torch.Tensor:
    """The whole forward as one opaque torch op: what a traced or compiled model records.

    Why everything happens in here: under ``torch.compile`` (vLLM's default mode traces the model
    with Dynamo, ``fullgraph``) Dynamo cannot step through ctypes, the cached library load (a
    ``stat``), the settings read from the environment or the prefill callback. Inside the op they
    run at every call, eagerly, so ``QUANTREG_CPU_MXFP4_ISA`` / ``_PRECISION`` are still read per
    forward (not frozen into a trace). ``gemm_min_tokens`` < 0: the precision's
    :data:`GEMM_MIN_TOKENS`; ``precision_name`` "": the process default (:func:`precision`).
    """
    prec = precision_name or precision()
    threshold = GEMM_MIN_TOKENS[prec] if gemm_min_tokens < 0 else gemm_min_tokens
    return _forward(x, topk_ids, topk_weights, w13, w13_scale, w13_bias, w2, w2_scale, w2_bias, activation, alpha,
                    limit, isa(), prec, threshold)


def _moe_forward_fake(x: torch.Tensor, *_: Any) -> torch.Tensor:
    """Shape and dtype of the output (``x``'s), for tracing with fake tensors."""
    return torch.empty_like(x)


# Not as decorators: torch.library's decorators are untyped (mypy --strict).
_MOE_FORWARD_OP: Any = torch.library.custom_op("quantreg_cpu_mxfp4::moe_forward", _moe_forward_impl, mutates_args=(),
                                               device_types="cpu")
_MOE_FORWARD_OP.register_fake(_moe_forward_fake)


def moe_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: PackedExperts,
    w13_bias: torch.Tensor | None,
    w2: PackedExperts,
    w2_bias: torch.Tensor | None,
    *,
    activation: str = "swigluoai",
    alpha: float = 1.702,
    limit: float = 7.0,
    gemm_min_tokens: int | None = None,
    precision: str | None = None,
) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * (W2_e act(W13_e x_t + b13_e) + b2_e)`` for ``e = topk_ids[t, k]``.

    ``x`` bf16 (or fp16/fp32) ``[T, H]``; ``topk_ids`` int32/int64 ``[T, k]`` of *local* expert ids
    (ids outside ``[0, E)`` contribute 0, as on an expert-parallel rank); ``topk_weights``
    ``[T, k]`` (fp32). ``activation`` ``"swigluoai"``: w13 rows interleaved (gate = rows 0::2,
    up = rows 1::2), ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = min(gate, limit)``; ``"silu"``: w13 = ``[gate; up]`` halves, ``silu(gate) * up``
    (``alpha``/``limit`` unused). Biases bf16/fp32 ``[E, 2I]`` / ``[E, H]`` or None. Returns
    ``[T, H]`` in ``x``'s dtype. Raises ``RuntimeError`` if the extension is not built.
    ``gemm_min_tokens``: experts with at least this many routed tokens take the prefill path
    (None: :data:`GEMM_MIN_TOKENS` for the precision; 0: none; tests and bench pin a path with it).
    ``precision``: "q8x2" or "q8" (a rule's ``precision`` option); None: the process default.
    """
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    # Only tensor work and one op call here: this function is traced by Dynamo (vLLM's default
    # mode); the library load, the settings and the C call happen inside the op.
    out: torch.Tensor = torch.ops.quantreg_cpu_mxfp4.moe_forward(
        x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous(), w13.blocks, w13.scales,
        None if w13_bias is None else w13_bias.contiguous(), w2.blocks, w2.scales,
        None if w2_bias is None else w2_bias.contiguous(), activation, float(alpha), float(limit),
        -1 if gemm_min_tokens is None else int(gemm_min_tokens), precision or "")
    return out
