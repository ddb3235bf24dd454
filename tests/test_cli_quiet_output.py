"""Issue 33.6: vLLM's own log noise stays out of quantreg's answers (``--verbose`` lets it in).

Real ``quantreg`` console script, real vLLM import (``plan`` asks vLLM how it names the format):
on a CPU-only torch vLLM warns "Triton is installed, but doesn't include CPU backend" at import,
before it configures its logger, so the message used to land in ``plan``'s output.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm


def _quantreg(*args: str, cwd: Path) -> str:
    exe = shutil.which("quantreg", path=str(Path(sys.executable).parent)) or "quantreg"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QUANTREG_", "VLLM_LOGGING"))}
    done = subprocess.run([exe, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=True)
    return done.stdout + done.stderr


def test_plan_keeps_vllms_log_out_unless_verbose(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    _quantreg("tiny-model", "tiny", cwd=tmp_path)
    quiet = _quantreg("plan", "tiny", cwd=tmp_path)
    assert "Triton" not in quiet and "INFO" not in quiet, quiet
    assert "(gpt_oss_mxfp4, gpt_oss, <device>)" in quiet
    # --verbose lets vLLM's log in: checked without vLLM (the parser and the environment it sets)
    code = ("import os, sys; from quantreg import cli; a = cli.build_parser().parse_args(['plan', 'x', '--verbose']); "
            "print(a.verbose)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
        == "True"
