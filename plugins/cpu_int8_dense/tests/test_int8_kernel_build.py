"""The kernel is optional and proves itself before it is chosen (issue 46, class 2).

* A build without a working compiler says so in one line and still installs the package; the
  kernel method's probe then answers "unavailable: extension not built (the build failed: ...)".
* The build needs no torch: the library links nothing of torch's.
* A library file that is not a library, or of another ABI version, is "unavailable" by the probe
  (which reads the file without loading it), and the method's constructor -- where quantreg's seam
  contains a failure -- raises with the reason, never the first forward.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from quantreg.testing.packaging import build_without_compiler

PLUGIN = Path(__file__).resolve().parent.parent


def _copy_sources(dest: Path) -> Path:
    root = dest / "cpu_int8_dense"
    root.mkdir()
    for name in ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md"):
        shutil.copy(PLUGIN / name, root / name)
    shutil.copytree(PLUGIN / "csrc", root / "csrc")
    shutil.copytree(PLUGIN / "quantreg_cpu_int8_dense", root / "quantreg_cpu_int8_dense",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", "BUILD_FAILED.txt"))
    return root


def _in(root: Path, code: str) -> Any:
    """The JSON value the last line of ``code``, run with ``root`` first on the path, printed."""
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_build_without_compiler_prints_one_line_and_the_probe_says_not_built(tmp_path: Path) -> None:
    root = _copy_sources(tmp_path)
    build_without_compiler(root, "quantreg-cpu-int8-dense")  # the kit's check: exit 0, one line, no traceback
    assert not list((root / "quantreg_cpu_int8_dense").glob("*.so"))
    assert (root / "quantreg_cpu_int8_dense" / "BUILD_FAILED.txt").read_text().strip()
    ok, why = _in(root, "import json; from quantreg_cpu_int8_dense import probe; "
                        "print(json.dumps(probe.kernel_available()))")
    assert ok is False and why.startswith("unavailable: extension not built (the build failed: "), why


@pytest.mark.parametrize(("content", "said"), [
    (b"not a library at all", "is not a shared library (no ELF header)"),
    (b"\x7fELF" + b"\0" * 64 + b"quantreg-cpu-int8-dense ABI 0;", "is not of ABI version 2"),
])
def test_a_wrong_library_is_unavailable_and_the_method_fails_when_built(tmp_path: Path, content: bytes,
                                                                         said: str) -> None:
    pytest.importorskip("vllm")
    root = _copy_sources(tmp_path)
    (root / "quantreg_cpu_int8_dense" / "libquantreg_cpu_int8_dense.so").write_bytes(content)
    ok, why = _in(root, "import json; from quantreg_cpu_int8_dense import probe; "
                        "print(json.dumps(probe.kernel_available()))")
    assert ok is False and why.startswith("unavailable: extension not built (libquantreg_cpu_int8_dense.so ") \
        and said in why, why
    built = _in(root, "import json\n"
                      "from vllm.model_executor.layers.linear import UnquantizedLinearMethod\n"
                      "from quantreg_cpu_int8_dense.kernel_method import CpuInt8KernelDenseMethod\n"
                      "try:\n    CpuInt8KernelDenseMethod(UnquantizedLinearMethod())\n    print(json.dumps('built'))\n"
                      "except RuntimeError as exc:\n    print(json.dumps(str(exc)))\n")
    assert isinstance(built, str) and built.startswith(
        "quantreg_cpu_int8_dense's compiled kernel is not available (extension not built: "), built


def test_the_built_library_depends_on_no_torch() -> None:
    """What makes one wheel load under every torch: nothing of torch's C++ ABI in the library."""
    from quantreg_cpu_int8_dense import probe

    if not probe.LIBRARY.is_file():
        pytest.skip(f"no {probe.LIBRARY.name} in this install: {probe.kernel_available()[1]}")
    data = probe.LIBRARY.read_bytes()
    for needle in (b"libtorch", b"libc10", b"_ZN3c10", b"_ZN2at", b"PyInit_", b"pybind11"):
        assert needle not in data, needle
    for symbol in (b"qr8_linear", b"qr8_pack", b"qr8_cpu_supports", b"qr8_abi_version", probe.ABI_MARKER):
        assert symbol in data, symbol
