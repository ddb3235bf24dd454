"""docs/operating.md's "two opt-in tables" command: both plugins' packaged tables in one QUANTREG_CONFIG.

The page tells an operator to run ``QUANTREG_CONFIG=$(python -m quantreg_cpu_mxfp4):$(python -m
quantreg_cpu_int8_dense)``. Run here as written (bash expands it, the real console script reads the
installed plugins' YAML), for the experts key and the lm_head key, on both host kinds by simulation:
each table decides its own keys and neither shadows the other.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from quantreg.host import simulate

pytestmark = pytest.mark.needs("quantreg_cpu_mxfp4", "quantreg_cpu_int8_dense")

OPERATING = Path(__file__).resolve().parent.parent / "docs" / "operating.md"


def _config_prefix() -> str:
    """The ``QUANTREG_CONFIG=...`` assignment of the page's opt-in command."""
    pattern = r"^(QUANTREG_CONFIG=\$\(python -m quantreg_cpu_mxfp4\):\$\(python -m quantreg_cpu_int8_dense\)) "
    found = re.findall(pattern, OPERATING.read_text(encoding="utf-8"), re.MULTILINE)
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("kind", ["avx2", "amx"])
def test_both_opt_in_tables_decide_their_own_keys(kind: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    prefix = _config_prefix()
    lines = {}
    keys = (("experts", "gpt_oss_mxfp4 gpt_oss cpu"), ("lm_head", "gpt_oss_mxfp4 gpt_oss cpu --layer lm_head"))
    for name, args in keys:
        done = subprocess.run(["bash", "-c", f"{prefix} quantreg explain {args}"], capture_output=True, text=True,
                              timeout=300, env={**env, **simulate(kind)}, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        lines[name] = done.stdout.splitlines()
    experts, lm_head = lines["experts"], lines["lm_head"]
    # the experts: q8.yaml's chain; vLLM's own kernel with AMX, plugin #2 with precision q8 without
    assert experts[1] == f"method   {'vllm' if kind == 'amx' else 'cpu_mxfp4'}", experts
    assert "q8.yaml:" in experts[2] and "options  {'precision': 'q8'}" in experts, experts
    # the lm_head: dense_int8.yaml's chain, plugin #3's own kernel on every x86-64 kind
    assert lm_head[1] == "method   cpu_int8_dense_kernel" and "dense_int8.yaml:" in lm_head[2], lm_head
