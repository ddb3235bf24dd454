"""quantreg.native: a plugin's native library is loaded in a child process first (issue 53, class 3).

Every way a library can misbehave at load, as a real tiny ``.so`` compiled here with the system
compiler: a constructor that blocks forever, calls ``abort()``, segfaults, calls ``_exit(3)`` or
prints to stdout; a library missing an entry point, one of another ABI version, a file that is not
an ELF file, and a good one. For each, :func:`quantreg.native.check` answers (within the timeout
for the blocking one) with the documented reason, and the process asking is still alive: the
checks run in this very pytest process, so a crash here would fail the run, not the case.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from quantreg import native

pytestmark = pytest.mark.usefixtures("clean_env")

COMPILER = shutil.which("gcc") or shutil.which("cc")
ENTRY = "int qr_test_entry(void) { return 42; }\n"
ABI = "int qr_test_abi(void) { return %d; }\n"
CTOR = "__attribute__((constructor)) static void qr_test_ctor(void) { %s }\n"
HEADERS = "#include <stdio.h>\n#include <stdlib.h>\n#include <unistd.h>\n"
TIMEOUT = 3.0

#: case -> (C source or None for a non-ELF file, what check() must say: None = loads cleanly, else a fragment)
CASES: dict[str, tuple[str | None, str | None]] = {
    "blocks": (HEADERS + CTOR % "for (;;) pause();" + ENTRY + ABI % 1,
               f"did not finish loading within {TIMEOUT * 0.8:.1f}s (QUANTREG_PROBE_TIMEOUT {TIMEOUT:g}s): "
               "a constructor that blocks"),
    "aborts": (HEADERS + CTOR % "abort();" + ENTRY + ABI % 1,
               "kills the process that loads it (SIGABRT while loading)"),
    "segfaults": (HEADERS + CTOR % "*(volatile int*)0 = 1;" + ENTRY + ABI % 1,
                  "kills the process that loads it (SIGSEGV while loading)"),
    "exits": (HEADERS + CTOR % "_exit(3);" + ENTRY + ABI % 1,
              "ends the process that loads it (exit status 3 while loading)"),
    "prints": (HEADERS + CTOR % 'printf("quantreg: all methods safe\\n"); fflush(stdout);' + ENTRY + ABI % 1, None),
    "missing-symbol": (HEADERS + ABI % 1, "does not export qr_test_entry"),
    "wrong-abi": (HEADERS + ENTRY + ABI % 7, "has ABI version 7, this package expects 1 (qr_test_abi())"),
    "not-elf": (None, "does not load ("),
    "good": (HEADERS + ENTRY + ABI % 1, None),
}


def build(directory: Path, case: str, source: str | None) -> Path:
    library = directory / f"libqr_{case.replace('-', '_')}.so"
    if source is None:
        library.write_text("this is not a shared library\n")
        return library
    if COMPILER is None:
        pytest.skip("no C compiler")
    c_file = directory / f"{case}.c"
    c_file.write_text(source)
    subprocess.run([COMPILER, "-shared", "-fPIC", "-o", str(library), str(c_file)], check=True, capture_output=True,
                   timeout=120)
    return library


@pytest.fixture(scope="module")
def libraries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("native")
    return {case: build(root, case, source) for case, (source, _) in CASES.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_way_a_library_can_fail_at_load_is_one_reason_and_this_process_lives(
        case: str, libraries: dict[str, Path]) -> None:
    native.forget()
    started = time.monotonic()
    why = native.check(libraries[case], symbols=("qr_test_entry",), abi=("qr_test_abi", 1), timeout=TIMEOUT)
    took = time.monotonic() - started
    expected = CASES[case][1]
    if expected is None:
        assert why is None, why
        lib, problem = native.load(libraries[case], symbols=("qr_test_entry",), abi=("qr_test_abi", 1),
                                   timeout=TIMEOUT)
        assert problem == "" and lib is not None and lib.qr_test_entry() == 42
    else:
        assert why is not None and why.startswith(libraries[case].name) and expected in why, why
        assert "\n" not in why
        lib, problem = native.load(libraries[case], symbols=("qr_test_entry",), abi=("qr_test_abi", 1),
                                   timeout=TIMEOUT)
        assert lib is None and problem == why  # the cached verdict: never loaded here
    assert took < TIMEOUT + 5, took


def test_the_verdict_is_cached_per_file_identity_and_a_replaced_file_is_checked_again(tmp_path: Path) -> None:
    """A constructor that appends a line per load counts the children: one per (path, size, mtime)."""
    if COMPILER is None:
        pytest.skip("no C compiler")
    counter = tmp_path / "loads.txt"
    source = HEADERS + CTOR % f'FILE* f = fopen("{counter}", "a"); if (f) {{ fputs("x\\n", f); fclose(f); }}' + ENTRY
    library = build(tmp_path, "counting", source)
    native.forget()
    for _ in range(5):
        assert native.check(library, symbols=("qr_test_entry",), timeout=TIMEOUT) is None
    assert counter.read_text().count("x") == 1
    library.unlink()
    build(tmp_path, "counting", source + "int qr_test_more(void) { return 1; }\n")
    assert native.check(library, symbols=("qr_test_entry",), timeout=TIMEOUT) is None
    assert counter.read_text().count("x") == 2


def test_a_constructor_printing_to_stdout_does_not_reach_the_callers_stdout(libraries: dict[str, Path]) -> None:
    """``explain --json`` prints one JSON document on stdout: a library loaded while it runs must not add to it."""
    code = textwrap.dedent(f"""
        import json, sys
        from quantreg import native
        lib, why = native.load({str(libraries['prints'])!r}, symbols=("qr_test_entry",), abi=("qr_test_abi", 1))
        print(json.dumps([why, lib is not None]))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["", True]  # stdout is the JSON line alone ...
    assert "quantreg: all methods safe" in done.stderr  # ... the library's line went to stderr


def test_a_missing_file_is_a_reason_not_an_exception(tmp_path: Path) -> None:
    why = native.check(tmp_path / "libabsent.so", timeout=TIMEOUT)
    assert why is not None and why.startswith("libabsent.so unreadable (FileNotFoundError")
