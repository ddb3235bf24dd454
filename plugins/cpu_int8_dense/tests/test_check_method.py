"""``quantreg check-method cpu_int8_dense``: the kit's dense suite passes at its small shape (real vLLM
layers). The 20b shape (qkv 2880->5120, o_proj 4096->2880, lm_head 2880->201088) is the same command
with ``--shape 20b``: too heavy for CI, run by hand (its output is in bench/results/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm


def test_check_method_small_shape_conforms() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    done = subprocess.run([str(Path(sys.executable).parent / "quantreg"), "check-method", "cpu_int8_dense"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for kind in ("attention", "dense", "lm_head"):
        row = next(line for line in lines if f"forward_{kind}" in line)
        assert row.split()[0] == "PASS", row
    assert "cpu_int8_dense on cpu: conforms -- 5 passed, 0 failed, 0 skipped" in lines
