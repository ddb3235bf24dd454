"""The plugin as a user meets it, without vLLM: the method is registered by installing the
distribution, its opt-in table is printed by ``python -m quantreg_cpu_bf16_dense`` and, named as
``QUANTREG_CONFIG``, decides every dense kind for GPT-OSS on CPU -- on this host and on one quantreg
believes AVX2-only (the method declares ``cpu:avx2, cpu:fma`` only) -- while without it nothing
changes (the registry's default keeps vLLM's own bf16 layers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantreg.host import simulate

QUANTREG = Path(sys.executable).parent / "quantreg"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")} | env
    return subprocess.run(list(args), capture_output=True, text=True, env=full, timeout=300)


def test_python_m_prints_the_shipped_table() -> None:
    done = _run(sys.executable, "-m", "quantreg_cpu_bf16_dense")
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path.name == "dense_bf16.yaml" and path.is_file()
    assert "method: cpu_bf16_dense_kernel" in path.read_text()


@pytest.mark.parametrize("kind", ["here", "avx2"])
@pytest.mark.parametrize("layer", ["attention", "dense", "lm_head"])
def test_the_opt_in_table_decides_each_dense_kind(kind: str, layer: str) -> None:
    table = _run(sys.executable, "-m", "quantreg_cpu_bf16_dense").stdout.strip()
    extra = simulate("avx2") if kind == "avx2" else {}
    done = _run(str(QUANTREG), "explain", "gpt_oss_mxfp4", "gpt_oss", "cpu", "--layer", layer,
                QUANTREG_CONFIG=table, **extra)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1] == "method   cpu_bf16_dense_kernel", lines
    assert lines[2].startswith(f"rule     {table}:"), lines
    chain = next(line for line in lines if "cpu_bf16_dense_kernel: kernel built" in line)
    assert chain.startswith("  yes ") and "ISA path " in chain, chain


def test_without_the_table_nothing_changes() -> None:
    done = _run(str(QUANTREG), "explain", "gpt_oss_mxfp4", "gpt_oss", "cpu", "--layer", "dense")
    assert done.returncode == 0, done.stderr
    assert "cpu_bf16_dense_kernel" not in done.stdout.splitlines()[1], done.stdout
