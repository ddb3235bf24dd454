"""MXFP4 (OCP Microscaling, E2M1 elements with one E8M0 scale per 32) in plain torch.

One definition of the format for every method plugin and for the tests that judge them, so
that "dequantise" means the same bits everywhere:

* **Elements** are 4-bit E2M1 codes. Codes 0..7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15
  are the same magnitudes negated (8 is -0). Two codes share a byte: element ``2j`` is the
  **low** nibble of byte ``j`` and element ``2j+1`` the **high** nibble.
* **Scales** are E8M0 bytes, one per block of 32 elements along the input (K) dimension:
  byte ``b`` means ``2**(b - 127)``. ``b = 0`` is the smallest scale, ``2**-127`` (not zero),
  so its elements decode to bf16 subnormals, exactly. ``b = 255`` is NaN in the OCP MX spec
  (and in ``torch.float8_e8m0fnu``): every element of such a block decodes to NaN here.
  ``ldexp``-based dequantisers (transformers, vllm-gaudi) instead treat 255 as ``2**128`` and
  produce ±inf (NaN for ±0); no real checkpoint carries 255.
* **Layouts** accepted: vLLM's parameters, blocks ``uint8 [..., N, K/2]`` with scales
  ``uint8 [..., N, K/32]``, and the checkpoint's blocks ``uint8 [..., N, K/32, 16]`` with
  scales ``[..., N, K/32]``. Both dequantise to ``[..., N, K]``.

:func:`dequantize_mxfp4` is exact (every MXFP4 value is representable in bf16) and quick on CPU.
Big tensors (real checkpoints) go through one fused kernel compiled by ``torch.compile``
(:mod:`quantreg.formats.mxfp4_compiled`): on 2 AVX2 cores a GPT-OSS-20B expert layer (2 GB of
traffic) decodes ~4x faster than with the eager torch path below, which everything else uses (and
any host where compiling fails), and 20-30x faster than transformers' ``convert_moe_packed_tensors``
(``bench/dequant_bench.py``). Every table below is built with integer arithmetic only
(:func:`bf16_bits`), so the answer does not depend on the process flushing subnormals, and a
scale byte is folded into the *table index* rather than applied afterwards, so there is no
multiply, no special case for subnormal results (scale bytes 0 and 1) and none for NaN (255):

* **Four values per lookup** (CPU, when the tensor uses at most 32 distinct scale bytes, as a
  narrow exponent range does, e.g. ``random_mxfp4``'s trained-like default of 7):
  for each scale byte present, a 65,536-entry int64 table maps two packed bytes (read as one
  int16) to their four bf16 values. One pass adds ``65536 * rank(scale)`` to the int16s, one
  ``index_select`` writes the output: half the lookups of a per-byte table. Per index, the add
  (~1 ns, a broadcast ATen cannot vectorise well) and the lookup (~1.1-1.4 ns) are what limit it.
* **Two values per lookup** (any number of scales, any device, and the compiled kernel): one
  65,536-entry int32 table indexed by ``scale << 8 | byte``.

On CPU the work is cut into chunks of 4,096 blocks, below ATen's parallel grain, so each op runs
in the thread that calls it, and the chunks are shared out to ``torch.get_num_threads()`` Python
threads (the ops release the GIL). This keeps every temporary in L2 and avoids OpenMP barriers,
which stalled for seconds on a busy shared machine.
"""

from __future__ import annotations

import math
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import torch

from . import mxfp4_compiled

BLOCK_SIZE = 32
"""Elements per E8M0 scale, along the input dimension."""
BLOCK_BYTES = BLOCK_SIZE // 2
E8M0_BIAS = 127
E8M0_NAN = 255
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)
"""Value of each 4-bit code; index 8 is negative zero."""

_BF16_NAN = 0x7FC0
_DEFAULT_CHUNK_BLOCKS = 1 << 18  # off CPU: 4 MiB of packed bytes per step bounds the int32 index temporaries


def e8m0_scale(byte: int) -> float:
    """The float a scale byte stands for (``nan`` for 255)."""
    if not 0 <= byte <= 255:
        raise ValueError(f"an E8M0 scale is a byte, got {byte}")
    return math.nan if byte == E8M0_NAN else math.ldexp(1.0, byte - E8M0_BIAS)


def bf16_bits(value: float) -> int:
    """The bf16 bit pattern of ``value``, which must be exactly representable (or inf/nan).

    Pure integer/double arithmetic (``frexp``/``ldexp`` are exact), so tables built from it do not
    depend on the process's subnormal-flushing mode.
    """
    if math.isnan(value):
        return _BF16_NAN
    sign = 0x8000 if math.copysign(1.0, value) < 0 else 0
    magnitude = abs(value)
    if magnitude == 0.0:
        return sign
    if math.isinf(magnitude):
        return sign | 0x7F80
    mantissa, exponent = math.frexp(magnitude)  # magnitude = mantissa * 2**exponent, 0.5 <= mantissa < 1
    unbiased = exponent - 1
    if unbiased > 127:
        return sign | 0x7F80
    if unbiased >= -126:
        fraction = math.ldexp(mantissa, 8) - 128.0  # 7 fraction bits
        if fraction != int(fraction):
            raise ValueError(f"{value!r} is not representable in bf16")
        return sign | ((unbiased + 127) << 7) | int(fraction)
    steps = math.ldexp(magnitude, 133)  # subnormal: multiples of 2**-133
    if steps != int(steps):
        raise ValueError(f"{value!r} is not representable in bf16")
    return sign | int(steps)


def _pair(low: int, high: int) -> int:
    """Two bf16 bit patterns as the int32 whose bytes hold them in memory order (low first)."""
    if sys.byteorder == "little":
        word = low | (high << 16)
    else:
        word = high | (low << 16)
    return word - (1 << 32) if word >= 1 << 31 else word


@cache
def _pairs_by_scale(device: torch.device) -> torch.Tensor:
    """int64 [256 scale bytes, 256 bytes]: the two bf16 of a byte at that scale, as an int32 word
    (memory order, low nibble first), sign-extended. Scale 255 decodes every element to NaN."""
    rows = []
    for scale in range(256):
        factor = e8m0_scale(scale)
        codes = [_BF16_NAN if math.isnan(factor) else bf16_bits(v * factor) for v in E2M1_VALUES]
        rows.append([_pair(codes[b & 0xF], codes[b >> 4]) for b in range(256)])
    return torch.tensor(rows, dtype=torch.int64, device=device)


@cache
def _byte_table(device: torch.device) -> torch.Tensor:
    """int32 [65536]: index ``scale << 8 | byte`` -> the byte's two bf16 at that scale."""
    return _pairs_by_scale(device).to(torch.int32).reshape(-1)


def _quad_table(pairs: torch.Tensor, scale: int) -> torch.Tensor:
    """int64 [65536]: two packed bytes read as an int16 ``v`` -> their four bf16, at ``v + 32768``.

    A little-endian int16 holds the first byte in its low 8 bits; the output int64 holds that
    byte's pair in its low 32 bits. The +32768 shift (a roll of the table) lets the signed int16
    be used as an index without masking it.
    """
    row = pairs[scale]
    full = (row.view(256, 1) << 32) | (row.view(1, 256) & 0xFFFFFFFF)  # [second byte, first byte]
    return torch.roll(full.reshape(-1), 32768)


@cache
def _f64_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=device)
    scales = torch.tensor([e8m0_scale(b) for b in range(256)], dtype=torch.float64, device=device)
    return values, scales


def _rows(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """Normalise either layout to ``[R, 16]`` packed rows and ``[R]`` scales, plus the output shape."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() == scales.dim() + 1 and blocks.shape[-1] == BLOCK_BYTES and blocks.shape[:-1] == scales.shape:
        out_shape = (*scales.shape[:-1], scales.shape[-1] * BLOCK_SIZE)
    elif (blocks.dim() == scales.dim() and blocks.dim() >= 1 and blocks.shape[:-1] == scales.shape[:-1]
          and blocks.shape[-1] == scales.shape[-1] * BLOCK_BYTES):
        out_shape = (*blocks.shape[:-1], blocks.shape[-1] * 2)
    else:
        raise ValueError(
            f"blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} are not an MXFP4 pair: expected "
            "blocks [..., N, K/2] with scales [..., N, K/32] (vLLM) or blocks [..., N, K/32, 16] with "
            "scales [..., N, K/32] (checkpoint)"
        )
    return blocks.reshape(-1, BLOCK_BYTES), scales.reshape(-1), out_shape


def dequantize_mxfp4(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    *,
    chunk_blocks: int = _DEFAULT_CHUNK_BLOCKS,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode MXFP4 to ``dtype`` (default bf16), exactly, as ``[..., N, K]``.

    bf16 results are bit-identical to a float64 decode rounded to bf16 (and to transformers'
    ``convert_moe_packed_tensors`` wherever that is finite). ``float32``/``float16`` are the exact
    bf16 values converted once; ``float64`` uses :func:`dequantize_mxfp4_f64`. Work proceeds in
    chunks of at most ``chunk_blocks`` scale blocks to bound temporaries. ``out`` (bf16 only) is a
    contiguous tensor of the result's shape to write into, e.g. a buffer reused across layers.
    """
    if dtype == torch.float64:
        return dequantize_mxfp4_f64(blocks, scales)
    if dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise TypeError(f"cannot dequantise MXFP4 to {dtype}; use bfloat16, float16, float32 or float64")
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks must be positive, got {chunk_blocks}")
    packed, scale_bytes, out_shape = _rows(blocks, scales)
    device = blocks.device
    rows = packed.shape[0]
    if out is None:
        result = torch.empty(out_shape, dtype=torch.bfloat16, device=device)
    else:
        if dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or tuple(out.shape) != out_shape:
            raise ValueError(f"out needs dtype=bfloat16 and a bfloat16 tensor of shape {out_shape}, "
                             f"got {out.dtype} {tuple(out.shape)}")
        if not out.is_contiguous() or out.device != device:
            raise ValueError("out must be contiguous and on the device of the blocks")
        result = out
    if rows:
        _decode(packed, scale_bytes, result.view(rows, BLOCK_SIZE), chunk_blocks)
    return result if dtype == torch.bfloat16 else result.to(dtype)


_SERIAL_CHUNK_BLOCKS = 4096  # x 8 int16 = 32,768 elements per op: ATen's grain, so the op stays serial
_QUAD_MAX_SCALES = 32  # 512 KiB of table per distinct scale byte
_PARALLEL_MIN_CHUNKS = 8


def _decode(packed: torch.Tensor, scale_bytes: torch.Tensor, out: torch.Tensor, chunk_blocks: int) -> None:
    """Fill ``out`` ([R, 32] bf16) from ``packed`` ([R, 16] uint8) and ``scale_bytes`` ([R] uint8)."""
    device = packed.device
    if mxfp4_compiled.wanted(packed, scale_bytes, out):
        done = mxfp4_compiled.decode_chunks(packed, scale_bytes, out.view(torch.int32), _byte_table(device))
        packed, scale_bytes, out = packed[done:], scale_bytes[done:], out[done:]
        if not packed.shape[0]:
            return
    pairs = _pairs_by_scale(device)
    present = torch.bincount(scale_bytes, minlength=256).nonzero().flatten().tolist()
    quad = sys.byteorder == "little" and device.type == "cpu" and len(present) <= _QUAD_MAX_SCALES
    if quad:
        source = _as_int16(packed)  # [R, 8]: two bytes per index
        table = torch.cat([_quad_table(pairs, s) for s in present])
        rank_base = torch.zeros(256, dtype=torch.int32, device=device)
        rank_base[present] = torch.arange(len(present), dtype=torch.int32, device=device) * 65536 + 32768
        base = torch.index_select(rank_base, 0, scale_bytes.to(torch.int32)).unsqueeze(1)
        target = out.view(torch.int64)  # [R, 8]: four bf16 per lookup
        width = BLOCK_BYTES // 2
    else:
        source = packed
        table = _byte_table(device)
        base = (scale_bytes.to(torch.int32) << 8).unsqueeze(1)
        target = out.view(torch.int32)  # [R, 16]: two bf16 per lookup
        width = BLOCK_BYTES
    rows = packed.shape[0]
    if device.type != "cpu":
        step = chunk_blocks
        _decode_range(source, base, table, target, 0, rows, step, width)
        return
    step = min(chunk_blocks, _SERIAL_CHUNK_BLOCKS)
    workers = min(torch.get_num_threads(), -(-rows // (step * _PARALLEL_MIN_CHUNKS)))
    if workers <= 1:
        _decode_range(source, base, table, target, 0, rows, step, width)
        return
    share = -(-rows // workers)
    share += -share % step
    # Inference mode is per thread: the pool's threads take the caller's, or writing into an
    # inference tensor made by a caller under torch.inference_mode() raises there.
    inference = torch.is_inference_mode_enabled()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mxfp4-dequant") as pool:
        jobs = [pool.submit(_decode_range_in_mode, inference, source, base, table, target, start,
                            min(start + share, rows), step, width)
                for start in range(0, rows, share)]
        for job in jobs:
            job.result()


def _as_int16(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` ([R, 16] uint8) viewed as [R, 8] int16, copied first only if it cannot be viewed."""
    try:
        return packed.view(torch.int16)
    except RuntimeError:  # rows not contiguous, or an odd byte offset
        return packed.clone(memory_format=torch.contiguous_format).view(torch.int16)


def _decode_range_in_mode(inference: bool, source: torch.Tensor, base: torch.Tensor, table: torch.Tensor,
                          target: torch.Tensor, start: int, stop: int, step: int, width: int) -> None:
    """:func:`_decode_range` in a pool thread, under the calling thread's inference mode."""
    with torch.inference_mode(inference):
        _decode_range(source, base, table, target, start, stop, step, width)


def _decode_range(source: torch.Tensor, base: torch.Tensor, table: torch.Tensor, target: torch.Tensor,
                  start: int, stop: int, step: int, width: int) -> None:
    """Rows ``start:stop`` in chunks of ``step``: index = source + base, then one table lookup each."""
    index = torch.empty((min(step, stop - start), width), dtype=torch.int32, device=source.device)
    for lo in range(start, stop, step):
        hi = min(lo + step, stop)
        chunk = index[: hi - lo]
        torch.add(source[lo:hi], base[lo:hi], out=chunk)
        torch.index_select(table, 0, chunk.view(-1), out=target[lo:hi].view(-1))


def dequantize_mxfp4_f64(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Float64 decode, straight from the definition: the oracle the fast path is tested against."""
    packed, scale_bytes, out_shape = _rows(blocks, scales)
    values, powers = _f64_tables(blocks.device)
    low = values[(packed & 0xF).long()]
    high = values[(packed >> 4).long()]
    decoded = torch.stack((low, high), dim=-1).reshape(-1, BLOCK_SIZE)
    return (decoded * powers[scale_bytes.long()].unsqueeze(1)).reshape(out_shape)


def to_checkpoint_layout(blocks: torch.Tensor) -> torch.Tensor:
    """View vLLM-layout blocks ``[..., N, K/2]`` as checkpoint blocks ``[..., N, K/32, 16]``."""
    if blocks.shape[-1] % BLOCK_BYTES:
        raise ValueError(f"last dimension {blocks.shape[-1]} is not a multiple of {BLOCK_BYTES}")
    return blocks.reshape(*blocks.shape[:-1], blocks.shape[-1] // BLOCK_BYTES, BLOCK_BYTES)


# Midpoints between consecutive E2M1 magnitudes; at a tie the even code wins (round half to even).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def quantize_mxfp4(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise float weights ``[..., K]`` (K a multiple of 32) to vLLM-layout blocks and scales.

    OCP MX rules: the block's shared exponent is ``floor(log2(amax)) - 2`` (2 is E2M1's largest
    exponent), elements round to the nearest E2M1 value with ties to the even code and saturate at
    ±6, an all-zero block gets scale byte 0. Meant for building realistic test weights.
    """
    if weights.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"last dimension {weights.shape[-1]} is not a multiple of {BLOCK_SIZE}")
    if not torch.isfinite(weights).all():
        raise ValueError("cannot quantise non-finite weights")
    w = weights.detach().to(torch.float64).reshape(-1, BLOCK_SIZE)
    amax = w.abs().amax(dim=1)
    _, exponent = torch.frexp(amax)  # amax = m * 2**exponent with 0.5 <= m < 1
    shared = torch.where(amax > 0, exponent - 3, torch.full_like(exponent, -E8M0_BIAS))
    shared = shared.clamp(-E8M0_BIAS, E8M0_BIAS)
    magnitude = torch.ldexp(w.abs(), -shared.unsqueeze(1)).clamp(max=6.0)
    midpoints = torch.tensor(_MIDPOINTS, dtype=torch.float64, device=w.device)
    code = torch.bucketize(magnitude, midpoints)  # a tie lands on the lower of the two codes,
    code = code + (torch.isin(magnitude, midpoints) & (code % 2 == 1)).long()  # move it to the even one
    code = code | (torch.signbit(w).long() << 3)
    nibbles = code.to(torch.uint8).reshape(*weights.shape[:-1], weights.shape[-1])
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    scales = (shared + E8M0_BIAS).to(torch.uint8).reshape(*weights.shape[:-1], weights.shape[-1] // BLOCK_SIZE)
    return blocks.contiguous(), scales


def random_mxfp4(
    shape: tuple[int, ...],
    *,
    seed: int,
    scale_range: tuple[int, int] = (118, 124),
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniformly random valid MXFP4 weights of logical shape ``[..., N, K]`` (vLLM layout).

    Every byte is a valid pair of codes; scale bytes are drawn from ``scale_range`` (inclusive),
    by default 2**-9..2**-3 so decoded weights look like a trained layer's (|w| up to ~0.75).
    """
    if not shape or shape[-1] % BLOCK_SIZE:
        raise ValueError(f"the last dimension of {shape} must be a positive multiple of {BLOCK_SIZE}")
    low, high = scale_range
    if not 0 <= low <= high <= 255:
        raise ValueError(f"scale_range {scale_range} must be bytes with low <= high")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    *lead, k = shape
    blocks = torch.randint(0, 256, (*lead, k // 2), dtype=torch.uint8, generator=generator)
    scales = torch.randint(low, high + 1, (*lead, k // BLOCK_SIZE), dtype=torch.uint8, generator=generator)
    return blocks.to(device), scales.to(device)
