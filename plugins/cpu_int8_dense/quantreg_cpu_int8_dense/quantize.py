"""Symmetric per-output-channel int8 weights: the one quantiser of both int8 methods.

Why one home: the oneDNN method (``method.py``) and the plugin's own kernel (``kernel.py``) must give
the same int8 weights for the same bf16 ones (tune and the docs compare them), and the kernel's AVX2
path relies on codes within ±127 (never -128: no int16 pair sum can saturate).
"""

from __future__ import annotations

import torch


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
