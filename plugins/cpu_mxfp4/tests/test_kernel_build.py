"""The extension is optional: a build without a working compiler says so in one line and still
installs the package, whose ``status()`` then answers "extension not built" (never a crash)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PLUGIN = Path(__file__).resolve().parent.parent


def _copy_sources(dest: Path) -> Path:
    root = dest / "cpu_mxfp4"
    root.mkdir()
    for name in ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md"):
        if (PLUGIN / name).exists():
            shutil.copy(PLUGIN / name, root / name)
    (root / "README.md").touch()
    shutil.copytree(PLUGIN / "csrc", root / "csrc")
    shutil.copytree(PLUGIN / "quantreg_cpu_mxfp4", root / "quantreg_cpu_mxfp4",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", "BUILD_FAILED.txt"))
    return root


def test_build_without_compiler_prints_one_line_and_status_says_not_built(tmp_path: Path) -> None:
    root = _copy_sources(tmp_path)
    env = {**os.environ, "CXX": "/bin/false", "CC": "/bin/false"}
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    lines = [line for line in output.splitlines() if "compiled kernel NOT built" in line]
    assert len(lines) == 1, output
    assert lines[0].startswith("quantreg-cpu-mxfp4: compiled kernel NOT built (")
    assert "Traceback" not in output, output
    assert not list((root / "quantreg_cpu_mxfp4").glob("_C*.so"))
    assert (root / "quantreg_cpu_mxfp4" / "BUILD_FAILED.txt").read_text().strip()

    probe = ("import json; from quantreg_cpu_mxfp4 import kernel; "
             "print(json.dumps(kernel.status()))")
    run = subprocess.run([sys.executable, "-c", probe], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, timeout=120, check=True)
    ok, why = json.loads(run.stdout.strip().splitlines()[-1])
    assert ok is False
    assert why.startswith("extension not built: the build failed: "), why
