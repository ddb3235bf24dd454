"""The int8 weight quantisers of both methods.

* :func:`quantize_per_channel` -- symmetric int8 per output row: what vLLM's oneDNN W8A8 GEMM takes
  (``cpu_int8_dense``, ``method.py``); one scale per row of K values.
* :func:`quantize_blocks` -- symmetric int8 per (row, 32-block along K) with fp16 scales, as
  llama.cpp's Q8_0 stores a weight (``cpu_int8_dense_kernel``, ``kernel.py``; issue 54: a row's one
  large value no longer coarsens the rest of the row, only its own block of 32).

Both keep codes within +-127 (never -128): the kernel's AVX2 path relies on it (no int16 pair sum
can saturate).
"""

from __future__ import annotations

import torch

BLOCK = 32
"""Values per scale along K (Q8_0's ``QK8_0``)."""
_FP16_MAX = 65504.0


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (q [N, K] int8 in [-127, 127], scale [N] float32), ``q * scale ~= weight``.

    In row chunks, so the float32 temporary of a 201,088 x 2,880 lm_head is never whole.
    """
    n = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.float32)
    step = 8192
    for start in range(0, n, step):
        rows = weight[start:start + step].float()
        s = rows.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q[start:start + step] = torch.round(rows / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scale[start:start + step] = s
    return q, scale


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per (row, 32-block along K), Q8_0's rounding: ``(q [N, K] int8, scale [N, ceil(K/32)] fp16)``.

    ``d = max|w| / 127`` per block, stored in fp16 as GGUF does, and ``q = round(w / fp16(d))`` with
    the stored scale (so ``q * scale`` is the weight the kernel multiplies; an fp16 rounding down of
    ``d`` moves ``max|w| / d`` by at most 127 x 2^-11, which still rounds to 127). A block whose scale
    exceeds fp16's range (``max|w| > 8.3e6``) is refused with a ValueError naming the row. In row
    chunks, so the float32 temporary of a 201,088 x 2,880 lm_head is never whole.
    """
    n, k = int(weight.shape[0]), int(weight.shape[1])
    blocks = (k + BLOCK - 1) // BLOCK
    q = torch.empty((n, k), dtype=torch.int8)
    scale = torch.empty((n, blocks), dtype=torch.float16)
    step = 8192
    for start in range(0, n, step):
        rows = weight[start:start + step].float()
        if blocks * BLOCK != k:
            rows = torch.nn.functional.pad(rows, (0, blocks * BLOCK - k))
        rows = rows.reshape(rows.shape[0], blocks, BLOCK)
        d = rows.abs().amax(dim=2) / 127.0
        if not bool(torch.isfinite(d).all()) or float(d.max()) > _FP16_MAX:
            bad = int(start + torch.nonzero(~(torch.isfinite(d) & (d <= _FP16_MAX)))[0, 0])
            raise ValueError(f"weight row {bad}: a 32-block's scale max|w|/127 is not finite or exceeds fp16's "
                             f"range ({_FP16_MAX:g}); the block-scaled kernel cannot hold it")
        d16 = d.to(torch.float16)
        div = d16.float()[:, :, None]
        codes = torch.where(div > 0, torch.round(rows / div.clamp(min=2.0**-24)), 0.0).clamp_(-127, 127).to(torch.int8)
        q[start:start + step] = codes.reshape(codes.shape[0], blocks * BLOCK)[:, :k]
        scale[start:start + step] = d16
    return q, scale
