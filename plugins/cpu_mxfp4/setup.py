"""Build of ``quantreg-cpu-mxfp4``: the package plus an optional compiled extension ``quantreg_cpu_mxfp4._C``.

Why a ``setup.py`` next to ``pyproject.toml``: the extension is a ``torch.utils.cpp_extension``
build, which needs torch importable at build time, and it is *optional*: if torch is not importable,
or the compiler is missing or fails, the build prints one line saying so and installs the
pure-Python package anyway; at run time ``quantreg_cpu_mxfp4.kernel.status()`` then answers
``(False, "extension not built: ...")`` and a fallback chain moves on.

ISA: every file is compiled for the baseline x86-64 target; the AVX2 and AVX-512 kernels carry
``__attribute__((target(...)))`` and are chosen at run time, so one wheel runs on every host
(never ``-march=native``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
SOURCES = ["csrc/moe.cpp", "csrc/gemv_avx2.cpp", "csrc/gemv_avx512.cpp", "csrc/decode_bf16.cpp"]
FAILURE_FILE = "BUILD_FAILED.txt"
NOT_BUILT = "quantreg-cpu-mxfp4: compiled kernel NOT built ({reason}); installing the pure-Python package only"


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
        target = HERE / "quantreg_cpu_mxfp4" if in_place else Path(self.build_lib) / "quantreg_cpu_mxfp4"
        try:
            target.mkdir(parents=True, exist_ok=True)
            (target / FAILURE_FILE).write_text(reason + "\n")
        except OSError:
            pass

    def run(self) -> None:
        self._in_place = bool(self.inplace)
        # A failure note from an earlier build in the same build directory would be installed
        # beside a good extension (and name a failure that no longer holds).
        stale = Path(self.build_lib) / "quantreg_cpu_mxfp4" / FAILURE_FILE
        if stale.exists():
            stale.unlink()
        try:
            super().run()
        except Exception as exc:  # compiler missing, compile or link error, ...
            self._failed(exc)

    def build_extension(self, ext: object) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._failed(exc)


def _extensions() -> tuple[list[object], dict[str, type]]:
    if os.environ.get("QUANTREG_CPU_MXFP4_NO_EXTENSION"):
        print(NOT_BUILT.format(reason="QUANTREG_CPU_MXFP4_NO_EXTENSION is set"), file=sys.stderr, flush=True)
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as exc:  # torch not importable in this build environment
        print(NOT_BUILT.format(reason=f"torch not importable: {_one_line(exc)}"), file=sys.stderr, flush=True)
        return [], {}

    class Build(OptionalBuildExt, BuildExtension):  # type: ignore[misc, valid-type]
        pass

    ext = CppExtension(
        "quantreg_cpu_mxfp4._C",
        SOURCES,
        extra_compile_args=["-O3", "-g0", "-fopenmp", "-Wall", "-Wno-unknown-pragmas", "-Wno-maybe-uninitialized"],
        extra_link_args=["-fopenmp"],
    )
    stale = HERE / "quantreg_cpu_mxfp4" / FAILURE_FILE  # from an earlier failed in-place build
    if stale.exists():
        stale.unlink()
    return [ext], {"build_ext": Build}


os.chdir(HERE)
_ext_modules, _cmdclass = _extensions()
setup(ext_modules=_ext_modules, cmdclass=_cmdclass)
