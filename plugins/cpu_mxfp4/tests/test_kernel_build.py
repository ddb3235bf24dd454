"""The kernel is optional: a build without a working compiler says so in one line and still
installs the package, whose ``status()`` then answers "extension not built" (never a crash).
And the build needs no torch: the library links nothing of torch's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from quantreg.testing.packaging import build_without_compiler

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
    build_without_compiler(root, "quantreg-cpu-mxfp4")  # the kit's check: exit 0, one line, no traceback
    assert not list((root / "quantreg_cpu_mxfp4").glob("*.so"))
    assert (root / "quantreg_cpu_mxfp4" / "BUILD_FAILED.txt").read_text().strip()

    probe = ("import json; from quantreg_cpu_mxfp4 import kernel; "
             "print(json.dumps(kernel.status()))")
    run = subprocess.run([sys.executable, "-c", probe], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, timeout=120, check=True)
    ok, why = json.loads(run.stdout.strip().splitlines()[-1])
    assert ok is False
    assert why.startswith("extension not built (the build failed: "), why


def test_the_built_library_depends_on_no_torch() -> None:
    """What makes one wheel load under every torch: nothing of torch's C++ ABI in the library
    (no libtorch / libc10 needed, no at:: / c10:: symbol), only its C entry points exported."""
    from quantreg_cpu_mxfp4 import kernel

    lib = Path(kernel.__file__).with_name(kernel.LIBRARY)
    if not lib.is_file():
        import pytest

        pytest.skip(f"no {kernel.LIBRARY} in this install: {kernel.status()[1]}")
    data = lib.read_bytes()
    for needle in (b"libtorch", b"libc10", b"_ZN3c10", b"_ZN2at", b"PyInit_", b"pybind11"):
        assert needle not in data, needle
    for symbol in (b"qr_moe_forward", b"qr_cpu_supports", b"qr_abi_version"):
        assert symbol in data, symbol
