"""quantreg.formats.mxfp4_compiled: the torch.compile'd decode gives the eager bits, or steps aside.

Runs the real compiler (inductor's C++ backend, gcc here). The failure paths are real too: a
broken C++ compiler in a subprocess, and a kernel that writes wrong bits, which must be caught by
the first-chunk check rather than reach a model.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from quantreg import settings
from quantreg.formats import mxfp4_compiled
from quantreg.formats.mxfp4 import dequantize_mxfp4, dequantize_mxfp4_f64

CHUNK = mxfp4_compiled.CHUNK_ROWS


def big_blocks(tail: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two whole chunks plus ``tail`` blocks holding every byte under every scale byte (0..255)."""
    rows = 2 * CHUNK + tail
    generator = torch.Generator().manual_seed(11)
    blocks = torch.randint(0, 256, (rows, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(0, 256, (rows,), dtype=torch.uint8, generator=generator)
    exhaustive = torch.arange(256, dtype=torch.uint8).reshape(16, 16).repeat(256, 1)  # [4096, 16]
    blocks[:4096] = exhaustive  # in the first chunk (the one the kernel's result is checked on)
    scales[:4096] = torch.arange(256, dtype=torch.uint8).repeat_interleave(16)
    end = rows - tail  # and at the end of the last whole chunk
    blocks[end - 4096:end] = exhaustive
    scales[end - 4096:end] = torch.arange(256, dtype=torch.uint8).repeat_interleave(16)
    return blocks.reshape(rows, 1, 16), scales.reshape(rows, 1)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def eager(blocks: torch.Tensor, scales: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setenv(settings.MXFP4_COMPILE, "0")
        return dequantize_mxfp4(blocks, scales)


def test_compiled_kernel_matches_float64_and_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    blocks, scales = big_blocks(tail=4099)
    monkeypatch.setenv(settings.MXFP4_COMPILE, "1")
    monkeypatch.setattr(mxfp4_compiled, "_disabled", None)
    compiled = dequantize_mxfp4(blocks, scales)
    assert mxfp4_compiled._kernel is not None and mxfp4_compiled._disabled is None  # it really ran
    exact = dequantize_mxfp4_f64(blocks, scales).to(torch.bfloat16)
    nan = torch.isnan(exact)
    assert torch.equal(torch.isnan(compiled), nan)
    assert torch.equal(bits(compiled)[~nan], bits(exact)[~nan])
    assert torch.equal(bits(compiled), bits(eager(blocks, scales, monkeypatch)))


def test_wrong_kernel_output_is_caught_and_eager_takes_over(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The first chunk is checked bit for bit: a miscompiled kernel never decides a weight."""
    blocks, scales = big_blocks(tail=5)
    calls: list[tuple[int, ...]] = []

    def miscompiled(out32: torch.Tensor, packed: torch.Tensor, scale_bytes: torch.Tensor, table: torch.Tensor) -> None:
        assert out32.dtype == torch.int32 and packed.dtype == scale_bytes.dtype == torch.uint8
        assert table.shape == (65536,) and table.dtype == torch.int32
        calls.append(tuple(packed.shape))
        out32.fill_(0x3F80)

    monkeypatch.setenv(settings.MXFP4_COMPILE, "1")
    monkeypatch.setattr(mxfp4_compiled, "_disabled", None)
    monkeypatch.setattr(mxfp4_compiled, "_kernel", miscompiled)
    with caplog.at_level("WARNING", logger="quantreg.formats.mxfp4_compiled"):
        result = dequantize_mxfp4(blocks, scales)
    assert calls == [(CHUNK, 16)]  # tried once, on the first chunk only
    assert "differ from the eager decode" in caplog.text
    assert mxfp4_compiled._disabled is not None
    assert torch.equal(bits(result), bits(eager(blocks, scales, monkeypatch)))
    assert not mxfp4_compiled.wanted(blocks.reshape(-1, 16), scales.reshape(-1), result.view(-1, 32))  # off for good


def test_small_tensors_and_mode_0_stay_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    big = mxfp4_compiled.AUTO_MIN_ROWS
    packed, scales = torch.zeros((big, 16), dtype=torch.uint8), torch.zeros(big, dtype=torch.uint8)
    out = torch.empty((big, 32), dtype=torch.bfloat16)
    monkeypatch.setattr(mxfp4_compiled, "_disabled", None)
    monkeypatch.setenv(settings.MXFP4_COMPILE, "auto")
    assert mxfp4_compiled.wanted(packed, scales, out)
    assert not mxfp4_compiled.wanted(packed[:CHUNK], scales[:CHUNK], out[:CHUNK])  # small: compiling would not pay
    assert not mxfp4_compiled.wanted(packed[:, ::2], scales, out)  # strided inputs would recompile
    assert not mxfp4_compiled.wanted(packed[:big // 2], scales[::2], out[:big // 2])
    monkeypatch.setenv(settings.MXFP4_COMPILE, "1")
    assert mxfp4_compiled.wanted(packed[:CHUNK], scales[:CHUNK], out[:CHUNK])
    assert not mxfp4_compiled.wanted(packed[:CHUNK - 1], scales[:CHUNK - 1], out[:CHUNK - 1])
    monkeypatch.setenv(settings.MXFP4_COMPILE, "0")
    assert not mxfp4_compiled.wanted(packed, scales, out)


def test_bad_mode_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.MXFP4_COMPILE, "yes")
    with pytest.raises(ValueError, match=r"QUANTREG_MXFP4_COMPILE='yes': expected one of auto, 0, 1"):
        dequantize_mxfp4(torch.zeros((2, 16), dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8))


def test_no_working_cxx_compiler_falls_back_with_one_warning(tmp_path: Path) -> None:
    """A host without a usable C++ compiler (CXX points at /bin/false, empty inductor cache)."""
    script = textwrap.dedent(f"""
        import logging, sys, torch
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(name)s %(message)s")
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_formats_mxfp4_compiled import big_blocks
        from quantreg.formats import mxfp4_compiled
        from quantreg.formats.mxfp4 import dequantize_mxfp4, dequantize_mxfp4_f64
        blocks, scales = big_blocks(tail=3)
        first = dequantize_mxfp4(blocks, scales)
        second = dequantize_mxfp4(blocks, scales)
        exact = dequantize_mxfp4_f64(blocks, scales).to(torch.bfloat16)
        finite = ~torch.isnan(exact)
        assert torch.equal(first.view(torch.int16)[finite], exact.view(torch.int16)[finite])
        assert torch.equal(first.view(torch.int16), second.view(torch.int16))
        print("DISABLED:", mxfp4_compiled._disabled)
    """)
    env = {**os.environ, "CXX": "/bin/false", "CC": "/bin/false",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), settings.MXFP4_COMPILE: "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stdout.splitlines() if "falls back to eager" in line]
    assert len(warnings) == 1, proc.stdout  # once per process, not once per tensor
    assert warnings[0].startswith("quantreg.formats.mxfp4_compiled ")
    assert "torch.compile failed" in warnings[0]
    assert "DISABLED: torch.compile failed" in proc.stdout
