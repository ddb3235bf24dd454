"""Fixtures the plugin's tests share."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

CheckMethod = Callable[..., tuple[subprocess.CompletedProcess[str], list[str]]]


@pytest.fixture
def check_method() -> CheckMethod:
    """Runs the installed ``quantreg check-method METHOD`` as a user would (no ``QUANTREG_*`` from the
    test's environment, then ``env``), asserts it exited ``code`` (0: nothing failed), and returns the run
    and its stdout lines."""

    def run(method: str, env: dict[str, str], code: int = 0) -> tuple[subprocess.CompletedProcess[str], list[str]]:
        full = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")} | env
        done = subprocess.run([str(Path(sys.executable).parent / "quantreg"), "check-method", method],
                              capture_output=True, text=True, env=full, timeout=900)
        assert done.returncode == code, done.stdout + done.stderr
        return done, done.stdout.splitlines()

    return run
