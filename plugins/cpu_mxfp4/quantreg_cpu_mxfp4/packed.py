"""The kernel's weight layout: :class:`PackedExperts`, vLLM's MXFP4 expert stacks repacked once at load.

Weight layout: :class:`PackedExperts` repacks vLLM's layout (rows of packed nibbles
``[E, N, K/2]`` and E8M0 bytes ``[E, N, K/32]``) once at load into a 16-row interleave of the
same byte count (``csrc/gemv.h``: per group of 16 rows and 32-block, dword ``d`` of the 16 rows
side by side, then their 16 scale bytes in a second stream), so a vector lane is one output row:
a GEMV job reads one sequential stream, and every 32-block of 16 rows costs one scale conversion
and no horizontal sum. Measured before the repack (1 token, 20B layer, one thread): the
row-major kernel took 0.72 ms per expert with its 13 MB in the last-level cache, against 0.19 ms
for a read pass over the same bytes -- instruction-bound, not memory-bound. The repack is a copy
into new tensors (the caller drops vLLM's, as the method does: resident bytes = packed bytes,
1.0x); rows past the last whole group of 16 stay row-major (a plain C loop computes them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 32
"""Elements per MXFP4 block (one E8M0 scale) along K."""
ROW_GROUP = 16


def _body_rows(n: int) -> int:
    """Rows stored in 16-row groups; the rest (``n % 16``) stay row-major after them."""
    return n - n % ROW_GROUP


def _interleave(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's row-major ``[E, N, K/2]`` / ``[E, N, K/32]`` -> the 16-row interleave (new tensors, same shapes)."""
    e, n, half = blocks.shape
    nb, body = half // 16, _body_rows(n)
    groups = body // ROW_GROUP
    out_b = torch.empty_like(blocks, memory_format=torch.contiguous_format)
    out_s = torch.empty_like(scales, memory_format=torch.contiguous_format)
    flat_b, flat_s = out_b.view(e, n * half), out_s.view(e, n * nb)
    # dwords as int32 elements: 4 bytes move together, [E, G, row, block, d] -> [E, G, block, d, row]
    src = blocks[:, :body].contiguous().view(torch.int32).view(e, groups, ROW_GROUP, nb, 4)
    flat_b[:, :body * half].view(torch.int32).view(e, groups, nb, 4, ROW_GROUP).copy_(src.permute(0, 1, 3, 4, 2))
    flat_b[:, body * half:] = blocks[:, body:].reshape(e, -1)
    flat_s[:, :body * nb].view(e, groups, nb, ROW_GROUP).copy_(
        scales[:, :body].reshape(e, groups, ROW_GROUP, nb).permute(0, 1, 3, 2))
    flat_s[:, body * nb:] = scales[:, body:].reshape(e, -1)
    return out_b, out_s


@dataclass(frozen=True)
class PackedExperts:
    """One MXFP4 weight stack (all experts of w13 or of w2) in the kernel's layout, made once at load.

    ``blocks`` uint8 ``[E, N, K/2]`` and ``scales`` uint8 ``[E, N, K/32]`` (E8M0), contiguous,
    the same shapes and byte count as vLLM's parameters but in the 16-row interleave the kernel
    streams (module docstring; ``csrc/gemv.h``). :meth:`from_vllm` makes them from vLLM's
    row-major parameters (a copy: the caller drops its own references afterwards, so resident
    memory stays the packed bytes); :meth:`to_vllm` gives the row-major form back.
    """

    blocks: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def from_vllm(cls, blocks: torch.Tensor, scales: torch.Tensor) -> PackedExperts:
        """Check vLLM's ``w*_weight`` / ``w*_weight_scale`` (row-major) and repack them for the kernel."""
        if blocks.dim() != 3 or scales.dim() != 3:
            raise ValueError(f"expected blocks [E, N, K/2] and scales [E, N, K/32], got {tuple(blocks.shape)} "
                             f"and {tuple(scales.shape)}")
        if blocks.device.type != "cpu" or scales.device.type != "cpu":
            raise ValueError(f"MXFP4 weights must be on the CPU, got {blocks.device} / {scales.device}")
        if blocks.dtype not in (torch.uint8, torch.int8) or scales.dtype not in (torch.uint8, torch.int8):
            raise ValueError(f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
        e, n, half = blocks.shape
        k = 2 * half
        if k == 0 or k % BLOCK_SIZE:
            raise ValueError(f"K = {k} (2 x blocks' last dimension) must be a positive multiple of {BLOCK_SIZE}")
        if tuple(scales.shape) != (e, n, k // BLOCK_SIZE):
            raise ValueError(f"scales {tuple(scales.shape)} do not match blocks {tuple(blocks.shape)}: expected "
                             f"{(e, n, k // BLOCK_SIZE)}")
        with torch.no_grad():
            return cls(*_interleave(blocks.detach().view(torch.uint8), scales.detach().view(torch.uint8)))

    def to_vllm(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The row-major ``(blocks, scales)`` vLLM loaded (new tensors): the inverse of :meth:`from_vllm`."""
        e, n, half = self.blocks.shape
        nb, body = half // 16, _body_rows(n)
        groups = body // ROW_GROUP
        blocks = torch.empty_like(self.blocks)
        scales = torch.empty_like(self.scales)
        src_b, src_s = self.blocks.view(e, n * half), self.scales.view(e, n * nb)
        blocks[:, :body].view(torch.int32).view(e, groups, ROW_GROUP, nb, 4).copy_(
            src_b[:, :body * half].view(torch.int32).view(e, groups, nb, 4, ROW_GROUP).permute(0, 1, 4, 2, 3))
        blocks[:, body:] = src_b[:, body * half:].view(e, n - body, half)
        scales[:, :body].view(e, groups, ROW_GROUP, nb).copy_(
            src_s[:, :body * nb].view(e, groups, nb, ROW_GROUP).permute(0, 1, 3, 2))
        scales[:, body:] = src_s[:, body * nb:].view(e, n - body, nb)
        return blocks, scales

    @property
    def num_experts(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def rows(self) -> int:
        """N: output features per expert."""
        return int(self.blocks.shape[1])

    @property
    def cols(self) -> int:
        """K: input features per expert (elements, not bytes)."""
        return int(self.blocks.shape[2]) * 2

    @property
    def nbytes(self) -> int:
        """Resident bytes of the packed form (blocks + scales)."""
        return int(self.blocks.numel() + self.scales.numel())
