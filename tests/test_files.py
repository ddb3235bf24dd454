"""quantreg.files: the one bounded, non-blocking way to read and to append (issue 21 class 2).

Everything that could hang runs in a subprocess with ``timeout=`` (a hang fails the test, it
does not stall the suite). The code walk fails on any other ``open(`` / ``read_text`` /
``read_bytes`` / ``os.open`` in quantreg/ than the ones listed with their reason.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from quantreg import files

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "quantreg"

#: (module, function) -> why it may open a file itself. Nothing here reads a path from outside.
ALLOWED = {
    ("quantreg/files.py", "read_regular"): "the one reader",
    ("quantreg/files.py", "append_regular"): "the one appender",
    ("quantreg/testing/vllm_run.py", "run_vllm"): "the kit's own log file in its temporary work dir (reads it back)",
    ("quantreg/testing/vllm_run.py", "group_alive"): "/proc/<pid>/stat of a child it started",
    ("quantreg/testing/vllm_run.py", "_read_result"): "the result file its own child wrote",
    ("quantreg/testing/vllm_child.py", "main"): "the request file its parent wrote",
    ("quantreg/newplugin.py", "render"): "its own packaged template files (quantreg/plugin_template/)",
    ("quantreg/testing/host_kind.py", "_sitecustomize_dir"): "the sitecustomize.py it wrote into its own temp dir",
    ("quantreg/testing/serving.py", "log"): "the log file of a test server it started",
    ("quantreg/pins.py", "compiled_sha256"): "a distribution's compiled files, hashed in 1 MiB blocks",
    # the one writer (quantreg/writing.py, class 12): opens only to create or replace, never reads
    ("quantreg/writing.py", "_fsync_dir"): "the target's directory, to fsync a rename",
    ("quantreg/writing.py", "replace_file"): "its own new temporary file (mkstemp) beside the target",
    ("quantreg/writing.py", "write_new"): "a new file (O_EXCL | O_NOFOLLOW)",
    ("quantreg/writing.py", "open_log"): "a child's log file, refused unless regular (O_NOFOLLOW, fstat)",
}
READERS = {"open", "read_text", "read_bytes", "fdopen"}
#: Libraries that open a path themselves (memory-map or read it): each use is allowed below, and the
#: function must refuse a non-regular file first (files.require_regular), since their ``open`` blocks on a FIFO.
LIBRARY_OPENERS = {"safe_open", "load_file", "torch.load", "mmap.mmap", "np.load", "numpy.load"}
GUARDED = {
    ("quantreg/models/checkpoint.py", "read_tensors"):
        "a checkpoint's shards (safe_open memory-maps them): tune's expert and dense weights",
    ("quantreg/tiny/checkpoint.py", "load_tensors"): "a tiny checkpoint's one safetensors file",
}
ALLOWED.update(GUARDED)
ALLOWED[("quantreg/testing/vllm_run.py", "load_moe_outputs")] = "the .pt file its own worker probe wrote"


def _opens(tree: ast.AST) -> list[tuple[str, int, str]]:
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call):
                func = child.func
                called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                dotted = (f"{func.value.id}.{func.attr}" if isinstance(func, ast.Attribute)
                          and isinstance(func.value, ast.Name) else called)
                if called in READERS:
                    found.append((function, child.lineno, called))
                elif called in LIBRARY_OPENERS or dotted in LIBRARY_OPENERS:
                    found.append((function, child.lineno, dotted if dotted in LIBRARY_OPENERS else called))
            visit(child, name)

    visit(tree, "<module>")
    return found


def test_no_other_way_to_open_a_file_in_quantreg() -> None:
    offenders = []
    used = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for function, line, called in _opens(ast.parse(path.read_text(encoding="utf-8"))):
            if (rel, function) not in ALLOWED:
                offenders.append(f"{rel}:{line}: {called}( in {function}")
            used.add((rel, function))
    assert offenders == [], "open files through quantreg.files: " + "; ".join(offenders)
    assert set(ALLOWED) <= used, f"stale allowances: {set(ALLOWED) - used}"


def test_a_library_that_opens_a_path_itself_gets_a_regular_file_first() -> None:
    """tune hung on a FIFO named model.safetensors (safe_open's open blocks): every function that
    hands a path to such a library calls files.require_regular in the same function."""
    for rel, function in GUARDED:
        tree = ast.parse((ROOT / rel).read_text(encoding="utf-8"))
        body = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
        calls = {c.func.id if isinstance(c.func, ast.Name) else getattr(c.func, "attr", "")
                 for c in ast.walk(body) if isinstance(c, ast.Call)}
        assert "require_regular" in calls and calls & {"safe_open", "load_file"}, (rel, function)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_require_regular_refuses_special_files_without_opening(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    os.symlink("/dev/zero", tmp_path / "zero")
    (tmp_path / "file").write_bytes(b"x")
    os.symlink(tmp_path / "file", tmp_path / "link")
    for name, reason in (("fifo", "a FIFO"), ("dir", "a directory"), ("zero", "a character device"),
                         ("missing", "no such file")):
        with pytest.raises(files.ReadRefused, match=reason):
            files.require_regular(tmp_path / name, expected="a safetensors file")
    files.require_regular(tmp_path / "file")
    files.require_regular(tmp_path / "link")  # a link to a regular file is that file
    with pytest.raises(files.ReadRefused, match="NUL"):
        files.require_regular("a\0b")


def test_the_walk_sees_what_it_must() -> None:
    """The walker itself: it finds each spelling (a walker that finds nothing would pass vacuously)."""
    code = "import os\nfrom pathlib import Path\ndef f(p):\n    open(p)\n    Path(p).read_text()\n" \
           "    Path(p).read_bytes()\n    os.fdopen(3)\n    safe_open(p)\n    torch.load(p)\n    load_file(p)\n"
    assert [c for _, _, c in _opens(ast.parse(code))] == ["open", "read_text", "read_bytes", "fdopen", "safe_open",
                                                          "torch.load", "load_file"]


def _run(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONIOENCODING": "utf-8"})


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_refused_by_every_reader_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "ck").mkdir()
    os.mkfifo(tmp_path / "ck" / "config.json")
    out = _run(f"""
        from quantreg import files, plan, audit
        try:
            files.read_regular({str(fifo)!r}, 100)
        except files.ReadRefused as exc:
            print("READ", exc)
        try:
            files.append_regular({str(fifo)!r}, b"x", 100)
        except files.WriteRefused as exc:
            print("APPEND", exc)
        print("PLAN", plan.read_checkpoint({str(tmp_path / "ck")!r}).problems)
        print("TRAIL", audit.summarise({str(fifo)!r}).problems)
    """)
    assert out.returncode == 0, out.stderr
    assert "READ is not a regular file (a FIFO)" in out.stdout
    assert "APPEND is not a regular file (a FIFO)" in out.stdout
    assert "not a regular file (a FIFO)" in out.stdout.split("PLAN", 1)[1]
    assert "not a regular file (a FIFO)" in out.stdout.split("TRAIL", 1)[1]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_trail_that_is_a_fifo_never_blocks_a_decision(tmp_path: Path) -> None:
    """``QUANTREG_DECISIONS`` naming a FIFO with no reader: record() returns, one WARNING, escaped path."""
    fifo = tmp_path / "trail\nFORGED LINE"
    os.mkfifo(fifo)
    code = ("import logging, sys\nlogging.basicConfig(stream=sys.stderr, level=logging.WARNING)\n"
            "from quantreg import audit\n"
            "print('WROTE', audit.append_record({'event': 'x'}), audit.append_record({'event': 'y'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "QUANTREG_DECISIONS": str(fifo)})
    assert out.returncode == 0, out.stderr
    assert "WROTE False False" in out.stdout
    warnings = [x for x in out.stderr.splitlines() if "decisions trail" in x]
    assert len(warnings) == 1 and "FIFO" in warnings[0] and "trail\\nFORGED LINE" in warnings[0]
    assert not any(x.startswith("FORGED") for x in out.stderr.splitlines())


def test_devices_and_directories_are_refused_without_opening(tmp_path: Path) -> None:
    for path, word in (("/dev/zero", "character device"), (str(tmp_path), "directory")):
        with pytest.raises(files.ReadRefused, match=word):
            files.read_regular(path, 10)
        with pytest.raises(files.WriteRefused, match=word):
            files.append_regular(path, b"x", 10)
    link = tmp_path / "zero.json"
    link.symlink_to("/dev/zero")
    with pytest.raises(files.ReadRefused, match="character device"):
        files.read_regular(link, 10)


def test_caps_hold_for_reads_and_appends(tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.write_bytes(b"x" * 100)
    with pytest.raises(files.ReadRefused, match="100 bytes"):
        files.read_regular(big, 99)
    assert files.read_regular(big, 10, head=True) == b"x" * 10
    with pytest.raises(files.WriteRefused, match="cap of 100"):
        files.append_regular(big, b"y", 100)
    files.append_regular(tmp_path / "new", b"line\n", 100)
    assert files.read_regular(tmp_path / "new", 100) == b"line\n"


@hsettings(max_examples=100, deadline=None)
@given(st.text(max_size=40) | st.binary(max_size=40).map(lambda b: b.decode("utf-8", "surrogateescape")))
def test_any_path_string_is_a_refusal_or_bytes_never_another_error(name: str) -> None:
    try:
        files.read_regular(name, 1 << 16)
    except files.ReadRefused as exc:
        assert str(exc)
    try:  # under a directory that does not exist; the name cannot climb out of it (an absolute name or
        # "../x" once wrote one byte to / itself: "/__init__.py" there breaks mypy in every checkout)
        files.append_regular(os.path.join("/nonexistent-dir-quantreg", "sub", name.replace(os.sep, "_")), b"x", 10)
    except files.WriteRefused as exc:
        assert str(exc)


def test_inside_keeps_shards_in_the_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "ck" / "out").symlink_to(tmp_path / "elsewhere")
    assert files.inside(tmp_path / "ck", "model-1.safetensors") == str(tmp_path / "ck" / "model-1.safetensors")
    for bad in ("../elsewhere/x.safetensors", "/etc/passwd", "out/x.safetensors", "", ".", "a\0b"):
        assert files.inside(tmp_path / "ck", bad) is None, bad


def test_trail_lines_are_strict_json_even_for_non_finite_values(tmp_path: Path) -> None:
    from quantreg import audit

    trail = tmp_path / "t.jsonl"
    assert audit.append_record({"event": "verify", "error": float("nan"), "tolerance": float("inf"),
                                "worst": [float("-inf")]}, path=trail)
    line = trail.read_text().strip()
    assert "NaN" not in line.replace('"NaN"', "") and "Infinity" not in line.replace('"Infinity"', "") \
        .replace('"-Infinity"', "")
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c}"))["error"] == "NaN"
