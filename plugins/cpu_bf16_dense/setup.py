"""Build of ``quantreg-cpu-bf16-dense``: the package plus an optional plain C shared library
``quantreg_cpu_bf16_dense/libquantreg_cpu_bf16_dense.so`` (the bf16 GEMV kernel of the
``cpu_bf16_dense_kernel`` method, loaded with ctypes by ``kernel.py``).

Why no torch here: the library has a C ABI on raw pointers and sizes (``csrc/dense.cpp``), includes
no torch header and links no torch library. So a plain ``pip install`` (build isolation on) needs
only setuptools and a C++ compiler, downloads no second torch, and the one built wheel loads under
every torch release. The wheel is tagged ``py3-none-<platform>``: the library is not a Python
extension module either.

Optional: if the compiler is missing or fails, the build prints one line saying so and installs
the pure-Python package anyway; the method's probe then answers
``(False, "unavailable: extension not built (...)")`` and a fallback chain moves on.

ISA: every file is compiled for the baseline x86-64 target; the AVX2 and AVX-512 BF16 kernels carry
``__attribute__((target(...)))`` (``csrc/bf16_dense.h``) and are chosen at run time, so one wheel
runs on every x86-64 host (never ``-march=native``). The three files compile in parallel (a few
seconds).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:  # setuptools >= 70.1 carries bdist_wheel; older ones need the "wheel" distribution
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # pragma: no cover
    from wheel.bdist_wheel import bdist_wheel  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
LIBRARY = "libquantreg_cpu_bf16_dense.so"
SOURCES = ["csrc/dense.cpp", "csrc/gemv_avx2.cpp", "csrc/gemv_avx512.cpp"]
FAILURE_FILE = "BUILD_FAILED.txt"
NOT_BUILT = "quantreg-cpu-bf16-dense: compiled kernel NOT built ({reason}); installing the pure-Python package only"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


class OptionalBuildExt(build_ext):
    """``build_ext`` whose failure is one printed line, not a failed install.

    The reason also goes into the package as ``BUILD_FAILED.txt``, so ``kernel.status()`` can say
    why even when the installer (pip) hid the build's output.
    """

    failed = False

    def _failed(self, exc: BaseException) -> None:
        if self.failed:
            return
        self.failed = True
        reason = _one_line(exc)
        print(NOT_BUILT.format(reason=reason), file=sys.stderr, flush=True)
        # setuptools clears self.inplace while building and copies to the source tree afterwards
        in_place = getattr(self, "_in_place", False)
        target = HERE / "quantreg_cpu_bf16_dense" if in_place else Path(self.build_lib) / "quantreg_cpu_bf16_dense"
        try:
            target.mkdir(parents=True, exist_ok=True)
            (target / FAILURE_FILE).write_text(reason + "\n")
        except OSError:
            pass

    def run(self) -> None:
        self._in_place = bool(self.inplace)
        # A failure note from an earlier build in the same build directory would be installed
        # beside a good extension (and name a failure that no longer holds).
        stale = Path(self.build_lib) / "quantreg_cpu_bf16_dense" / FAILURE_FILE
        if stale.exists():
            stale.unlink()
        try:
            super().run()
        except Exception as exc:  # compiler missing, compile or link error, ...
            self._failed(exc)

    def get_ext_filename(self, fullname: str) -> str:
        # A plain shared library, not a Python module: no Python ABI tag in its name.
        return os.path.join(*fullname.split(".")[:-1], LIBRARY)

    def build_extension(self, ext: Any) -> None:
        # The sources one per thread (a 2-core host: ~half the time of one after another).
        compile_one = self.compiler.compile

        def compile_all(sources: list[str], **kwargs: Any) -> list[str]:
            with ThreadPoolExecutor(max(1, min(len(sources), os.cpu_count() or 1))) as pool:
                return [obj for objs in pool.map(lambda src: compile_one([src], **kwargs), sources) for obj in objs]

        self.compiler.compile = compile_all  # type: ignore[method-assign]
        print(f"quantreg-cpu-bf16-dense: compiling the bf16 kernel ({len(ext.sources)} C++ files, a few seconds)...",
              file=sys.stderr, flush=True)
        start = time.monotonic()
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._failed(exc)
            return
        print(f"quantreg-cpu-bf16-dense: kernel compiled in {time.monotonic() - start:.0f} s", file=sys.stderr,
              flush=True)


class PlatformWheel(bdist_wheel):
    """``py3-none-<platform>``: the wheel holds a C library (platform-specific) and no CPython extension."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return "py3", "none", plat


def _extensions() -> tuple[list[Extension], dict[str, type]]:
    stale = HERE / "quantreg_cpu_bf16_dense" / FAILURE_FILE  # from an earlier failed in-place build
    if os.environ.get("QUANTREG_CPU_BF16_DENSE_NO_EXTENSION"):
        print(NOT_BUILT.format(reason="QUANTREG_CPU_BF16_DENSE_NO_EXTENSION is set"), file=sys.stderr, flush=True)
        return [], {"bdist_wheel": PlatformWheel}
    if stale.exists():
        stale.unlink()
    ext = Extension(
        "quantreg_cpu_bf16_dense._kernel",  # the name only places the file: get_ext_filename gives LIBRARY
        SOURCES,
        language="c++",
        extra_compile_args=["-std=c++17", "-O3", "-g0", "-fopenmp", "-fvisibility=hidden", "-Wall",
                            "-Wno-unknown-pragmas", "-Wno-maybe-uninitialized", "-Wno-uninitialized"],
        extra_link_args=["-fopenmp"],
    )
    return [ext], {"build_ext": OptionalBuildExt, "bdist_wheel": PlatformWheel}


os.chdir(HERE)
_ext_modules, _cmdclass = _extensions()
setup(ext_modules=_ext_modules, cmdclass=_cmdclass)
