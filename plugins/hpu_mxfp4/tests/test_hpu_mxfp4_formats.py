"""quantreg.formats.mxfp4: the fast bf16 decode is bit-exact against float64 and transformers."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

import pytest
import torch

from quantreg.formats.mxfp4 import (
    E2M1_VALUES,
    bf16_bits,
    dequantize_mxfp4,
    dequantize_mxfp4_f64,
    e8m0_scale,
    quantize_mxfp4,
    random_mxfp4,
    to_checkpoint_layout,
)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def every_byte_and_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """One 32-element block per (scale byte, 16 bytes): all 256 x 256 combinations."""
    blocks = torch.arange(256, dtype=torch.uint8).reshape(16, 16).repeat(256, 1)  # [4096, 16]
    scales = torch.arange(256, dtype=torch.uint8).repeat_interleave(16)  # [4096]
    return blocks.reshape(256, 16, 16), scales.reshape(256, 16)


def test_value_table_and_nibble_order() -> None:
    assert E2M1_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert [-v for v in E2M1_VALUES[:8]] == list(E2M1_VALUES[8:])
    assert math.copysign(1.0, E2M1_VALUES[8]) == -1.0  # code 8 is -0
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x71  # low nibble 1 (0.5) is element 0, high nibble 7 (6.0) element 1
    out = dequantize_mxfp4(blocks, torch.full((1, 1), 127, dtype=torch.uint8))
    assert out[0, :2].tolist() == [0.5, 6.0]


def test_e8m0_edges() -> None:
    assert e8m0_scale(127) == 1.0
    assert e8m0_scale(0) == 2.0**-127
    assert e8m0_scale(254) == 2.0**127
    assert math.isnan(e8m0_scale(255))
    assert bf16_bits(2.0**-127) == 0x0040  # a bf16 subnormal
    assert bf16_bits(1.5 * 2.0**127) == 0x7F40


def test_exhaustive_bytes_and_scales_match_float64() -> None:
    blocks, scales = every_byte_and_scale()
    fast = dequantize_mxfp4(blocks, scales)
    exact = dequantize_mxfp4_f64(blocks, scales).to(torch.bfloat16)
    assert fast.shape == (256, 16 * 32)
    nan = torch.isnan(exact)
    assert torch.equal(torch.isnan(fast), nan)
    assert nan[255].all() and not nan[:255].any()  # scale byte 255 is NaN for the whole block
    assert torch.equal(bits(fast)[~nan], bits(exact)[~nan])


def test_exact_when_subnormals_are_flushed() -> None:
    blocks, scales = every_byte_and_scale()
    exact = bits(dequantize_mxfp4_f64(blocks[:255], scales[:255]).to(torch.bfloat16))
    torch.set_flush_denormal(True)
    try:
        fast = dequantize_mxfp4(blocks[:255], scales[:255])
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(bits(fast), exact)


@pytest.mark.parametrize("chunk_blocks", [1, 7, 1 << 18])
def test_layouts_chunks_and_dtypes(chunk_blocks: int) -> None:
    blocks, scales = random_mxfp4((3, 40, 96), seed=7, scale_range=(0, 254))
    reference = dequantize_mxfp4_f64(blocks, scales)
    vllm_layout = dequantize_mxfp4(blocks, scales, chunk_blocks=chunk_blocks)
    checkpoint = dequantize_mxfp4(to_checkpoint_layout(blocks), scales, chunk_blocks=chunk_blocks)
    assert vllm_layout.shape == checkpoint.shape == (3, 40, 96)
    assert torch.equal(bits(vllm_layout), bits(checkpoint))
    assert torch.equal(bits(vllm_layout), bits(reference.to(torch.bfloat16)))
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), reference.to(torch.bfloat16).float())
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float64), reference)


def test_non_contiguous_views_decode_like_copies() -> None:
    blocks, scales = random_mxfp4((4, 32, 64), seed=3)
    view_b, view_s = blocks[1::2], scales[1::2]  # every other expert
    assert torch.equal(bits(dequantize_mxfp4(view_b, view_s)),
                       bits(dequantize_mxfp4(view_b.contiguous(), view_s.contiguous())))


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_bit_identical_to_transformers_on_finite_values() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4((2, 48, 128), seed=11, scale_range=(0, 254))
    ours = dequantize_mxfp4(to_checkpoint_layout(blocks), scales)
    theirs = convert_moe_packed_tensors(to_checkpoint_layout(blocks), scales).transpose(1, 2)  # -> [E, N, K]
    finite = torch.isfinite(theirs)
    assert finite.float().mean() > 0.99  # only the overflowing products at scale 254 are inf
    assert torch.equal(bits(ours)[finite], bits(theirs)[finite])
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))


def test_rejects_what_is_not_mxfp4() -> None:
    blocks, scales = random_mxfp4((2, 64), seed=1)
    with pytest.raises(TypeError, match="uint8"):
        dequantize_mxfp4(blocks.to(torch.int16), scales)
    with pytest.raises(ValueError, match="not an MXFP4 pair"):
        dequantize_mxfp4(blocks[:, :16], scales)
    with pytest.raises(TypeError, match="int8"):
        dequantize_mxfp4(blocks, scales, torch.int8)


def test_quantize_round_trips_and_rounds_half_to_even() -> None:
    weights = dequantize_mxfp4_f64(*random_mxfp4((5, 64), seed=2))
    blocks, scales = quantize_mxfp4(weights)
    assert torch.equal(dequantize_mxfp4_f64(blocks, scales), weights)  # representable values survive
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, 7.9, 0.1] + [4.0] * 22).reshape(1, 32)
    blocks, scales = quantize_mxfp4(ties)
    assert scales.item() == 127
    assert dequantize_mxfp4_f64(blocks, scales)[0, :10].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, 6.0, 0.0]
    zero_blocks, zero_scales = quantize_mxfp4(torch.zeros(2, 32))
    assert zero_scales.tolist() == [[0], [0]] and not zero_blocks.any()


def test_random_mxfp4_is_seeded() -> None:
    a = random_mxfp4((3, 64), seed=5)
    b = random_mxfp4((3, 64), seed=5)
    c = random_mxfp4((3, 64), seed=6)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])
    assert int(a[1].min()) >= 118 and int(a[1].max()) <= 124


def test_import_quantreg_does_not_import_torch() -> None:
    code = "import sys, quantreg, quantreg.formats; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
