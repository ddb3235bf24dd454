"""``quantreg check-method cpu_int8_dense``: the kit's dense suite passes at its small shape (real vLLM
layers) on a host with VNNI. The 20b shape (qkv 2880->5120, o_proj 4096->2880, lm_head 2880->201088)
is the same command with ``--shape 20b``: too heavy for CI, run by hand (its output is in bench/results/).

On a host without VNNI (AVX2-only) the method is declared unable to run (``host:
cpu:avx512_vnni|avx_vnni``; oneDNN's int8 GEMM saturates there, issue 46 class 3): the kit checks
what needs no device and SKIPS the forwards with that reason. Shown here on any host by simulated
flags (``quantreg.host.simulate("avx2")``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantreg.host import host_facts, simulate

pytestmark = pytest.mark.vllm
NO_VNNI = "needs cpu flag avx512_vnni or avx_vnni, this host has "


def vnni_here() -> bool:
    facts = host_facts()
    return facts.has("avx512_vnni") or facts.has("avx_vnni")


@pytest.mark.parametrize("kind", ["here", "avx2"])
def test_check_method_small_shape_conforms_where_the_method_runs(kind: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    if kind == "avx2":
        env.update(simulate("avx2"))
    done = subprocess.run([str(Path(sys.executable).parent / "quantreg"), "check-method", "cpu_int8_dense"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    if kind == "here" and vnni_here():
        for layer in ("attention", "dense", "lm_head"):
            row = next(line for line in lines if f"forward_{layer}" in line)
            assert row.split()[0] == "PASS", row
        assert "cpu_int8_dense on cpu: conforms -- 6 passed, 0 failed, 0 skipped" in lines
    else:  # the forwards are not attempted; the reason is the declaration's
        assert f"device cpu: NOT available ({NO_VNNI}" in lines[1], lines[:2]
        words = " ".join(done.stdout.split())  # the report wraps its details
        assert f"SKIPPED available {NO_VNNI}" in words, done.stdout
        assert not any("forward_" in line for line in lines), done.stdout
        assert lines[-1] == "cpu_int8_dense on cpu: no failures -- 1 passed, 0 failed, 1 skipped", lines[-1]
