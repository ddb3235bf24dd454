"""The one writer (quantreg/writing.py): refusals before work, atomic replacement, nothing left on failure.

Class 12 of docs/reliability.md. Three layers:

- a code walk: no write (``open(..., 'w')``, ``write_text``, ``os.replace``, ``shutil``, ``mkdir``,
  ``mkstemp``, ``torch.save``...) anywhere in quantreg/ outside quantreg/writing.py, quantreg/files.py
  (the appender) and :data:`ALLOWED` (each entry says why);
- a property over the writer itself: every kind of existing target (regular file, directory,
  FIFO, socket, character device, symlink to each, dangling symlink, missing parent, a parent
  that is a file, empty name) is either written atomically or refused with the target unchanged
  and no temporary left;
- a property over the CLI: every subcommand is classified in :data:`WRITERS` (a new subcommand
  fails :func:`test_every_subcommand_is_classified` until it is), and every writing command,
  given every kind of target, answers one ``quantreg CMD:`` line and exit 1/2 (the envelope
  under ``--json``) without touching it, before any heavy work.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantreg import cli
from quantreg.files import WriteRefused
from quantreg.writing import dir_target_problem, file_target_problem, replace_directory, replace_file

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "quantreg"
HOMES = {"quantreg/writing.py", "quantreg/files.py"}

#: (file, function) -> why a write there is not the one writer's.
ALLOWED: dict[tuple[str, str], str] = {
    ("quantreg/vllm/multinode.py", "tempfile.TemporaryDirectory"):
        "a scratch directory for shipped tables, removed when the with-block ends; the files go through write_new",
    ("quantreg/testing/vllm_child.py", "torch.save"):
        "serialises into an in-memory buffer (io.BytesIO); the bytes go through replace_file",
    ("quantreg/native.py", "tempfile.TemporaryFile"):
        "an unnamed scratch file for the probing child's output, deleted when closed; nothing is left on disk",
}

_WRITE_MODES = set("wax+")
_SHUTIL_READONLY = {"get_terminal_size", "which", "disk_usage"}
_TEMPFILE_WRITERS = {"mkstemp", "mkdtemp", "NamedTemporaryFile", "TemporaryDirectory", "TemporaryFile",
                     "SpooledTemporaryFile"}
_OS_WRITERS = {"replace", "rename", "renames", "makedirs", "mkdir", "mkfifo", "mknod", "link", "symlink",
               "truncate", "ftruncate"}


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _mode(call: ast.Call, position: int) -> str | None:
    for kw in call.keywords:
        if kw.arg == "mode" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
            return kw.value.value
    if len(call.args) > position and isinstance(call.args[position], ast.Constant):
        value = call.args[position].value
        return value if isinstance(value, str) else None
    return None


def _write_call(call: ast.Call) -> str | None:
    """The dotted name of a call that writes to the file system, else ``None``."""
    func = call.func
    name = _dotted(func)
    if isinstance(func, ast.Name) and func.id == "open":
        mode = _mode(call, 1)
        return "open" if mode and _WRITE_MODES & set(mode) else None
    if name in ("save_file", "save_pretrained"):
        return name
    if not isinstance(func, ast.Attribute):
        return None
    attr = func.attr
    owner = _dotted(func.value)
    if owner == "os" and attr in _OS_WRITERS:
        return name
    if owner == "os" and attr == "open":
        flags = ast.unparse(call.args[1]) if len(call.args) > 1 else ""
        return name if any(f in flags for f in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC")) else None
    if owner == "shutil" and attr not in _SHUTIL_READONLY:
        return name
    if owner == "tempfile" and attr in _TEMPFILE_WRITERS:
        return name
    if attr in ("write_text", "write_bytes", "mkdir", "touch", "symlink_to", "hardlink_to", "rename"):
        return f"*.{attr}"
    if attr == "replace" and len(call.args) == 1 and not call.keywords:  # Path.replace(target); str.replace has 2+
        return "*.replace"
    if attr == "open":  # Path.open("w")
        mode = _mode(call, 0)
        return "*.open" if mode and _WRITE_MODES & set(mode) else None
    if name in ("torch.save", "save_file", "safetensors.torch.save_file") or attr in ("save_file", "save_pretrained"):
        return name
    if attr == "save" and owner not in ("torch",) and call.args and not isinstance(call.args[0], ast.Dict):
        return "*.save"
    return None


def _writes() -> Iterator[tuple[str, int, str]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in HOMES:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                found = _write_call(node)
                if found is not None:
                    yield rel, node.lineno, found


def test_the_walk_sees_every_kind_of_write() -> None:
    """The walker itself: each form it must catch, caught (so an empty result means something)."""
    sample = """
open(p, "w"); open(p, mode="a"); Path(p).open("wb"); p.write_text("x"); p.write_bytes(b"")
os.replace(a, b); os.rename(a, b); os.makedirs(d); p.mkdir(); shutil.rmtree(d); shutil.copy(a, b)
tempfile.mkstemp(); tempfile.mkdtemp(); torch.save(t, p); save_file(t, p); tok.save(str(p)); p.replace(q)
os.open(p, os.O_WRONLY | os.O_CREAT)
open(p); open(p, "rb"); "a".replace("b", "c"); os.open(p, os.O_RDONLY); shutil.get_terminal_size()
"""
    found = [_write_call(n) for n in ast.walk(ast.parse(sample)) if isinstance(n, ast.Call)]
    assert len([f for f in found if f is not None]) == 18, found


def test_no_write_outside_the_one_writer() -> None:
    stray = [f"{rel}:{line}: {name}" for rel, line, name in _writes() if (rel, name) not in ALLOWED]
    assert stray == [], ("writes outside quantreg/writing.py: route them through replace_file / replace_directory "
                         "/ write_new / make_directory / open_log, or add them to ALLOWED with the reason:\n"
                         + "\n".join(stray))


# --- the writer itself, over every kind of target -------------------------------------------------------------

KINDS = ("missing", "regular", "empty-dir", "full-dir", "fifo", "socket", "chardev", "symlink-file",
         "symlink-dir", "symlink-dangling", "symlink-dev", "parent-missing", "parent-is-file", "empty-name", "proc",
         "sys")


@contextlib.contextmanager
def _target(base: Path, kind: str) -> Iterator[str]:
    """A path of ``kind`` under ``base`` (the character device is /dev/null itself, never written)."""
    sock = None
    target = base / "target"
    if kind == "regular":
        target.write_text("keep me")
    elif kind == "empty-dir":
        target.mkdir()
    elif kind == "full-dir":
        target.mkdir()
        (target / "inside").write_text("keep me")
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(target))
    elif kind == "chardev":
        target = Path("/dev/null")
    elif kind.startswith("symlink-"):
        dest = {"symlink-file": base / "dest.txt", "symlink-dir": base / "destdir",
                "symlink-dangling": base / "nowhere", "symlink-dev": Path("/dev/null")}[kind]
        if kind == "symlink-file":
            dest.write_text("keep me")
        elif kind == "symlink-dir":
            dest.mkdir()
        target.symlink_to(dest)
    elif kind in ("proc", "sys"):  # file systems that take no new files, whatever access() says to root
        target = Path(f"/{kind}/quantreg-test-target")
    elif kind == "parent-missing":
        target = base / "no" / "such" / "target"
    elif kind == "parent-is-file":
        (base / "file").write_text("keep me")
        target = base / "file" / "target"
    try:
        yield "" if kind == "empty-name" else str(target)
    finally:
        if sock is not None:
            sock.close()


def _snapshot(base: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    for path in sorted(base.rglob("*")):
        st_ = os.lstat(path)
        content: object = st_.st_mode
        if stat.S_ISREG(st_.st_mode):
            content = path.read_bytes()
        elif stat.S_ISLNK(st_.st_mode):
            content = os.readlink(path)
        out[path.relative_to(base).as_posix()] = content
    return out


def _refused_as_predicted(base: Path, problem: str | None, write: Callable[[], object]) -> bool:
    """Run ``write``; if it refuses (True), the refusal is ``problem`` word for word, on one line, and
    nothing under ``base`` changed (no temporary left). False: it wrote."""
    before = _snapshot(base)
    try:
        write()
    except WriteRefused as exc:
        assert problem is not None and str(exc) == problem
        assert "\n" not in str(exc)
        assert _snapshot(base) == before
        return True
    return False


def _dev_null_intact() -> bool:
    return stat.S_ISCHR(os.stat("/dev/null").st_mode)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(KINDS), replace_symlink=st.booleans(), data=st.binary(max_size=64))
def test_replace_file_writes_a_regular_file_or_refuses_untouched(tmp_path_factory: pytest.TempPathFactory,
                                                                   kind: str, replace_symlink: bool,
                                                                   data: bytes) -> None:
    base = tmp_path_factory.mktemp("w")
    with _target(base, kind) as target:
        problem = file_target_problem(target, replace_symlink=replace_symlink)
        if not _refused_as_predicted(base, problem, lambda: replace_file(target, data,
                                                                         replace_symlink=replace_symlink)):
            assert problem is None
            assert kind in ("missing", "regular") or (replace_symlink and kind.startswith("symlink-"))
            written = Path(target)
            assert not written.is_symlink() and written.read_bytes() == data
            assert [p for p in base.iterdir() if p.name.startswith(".")] == []
        assert _dev_null_intact()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(KINDS), force=st.booleans(), fail=st.booleans())
def test_replace_directory_is_all_or_nothing(tmp_path_factory: pytest.TempPathFactory, kind: str, force: bool,
                                             fail: bool) -> None:
    base = tmp_path_factory.mktemp("d")

    def fill(fresh: Path) -> None:
        (fresh / "a.txt").write_text("new")
        if fail:
            raise KeyboardInterrupt

    with _target(base, kind) as target:
        problem = dir_target_problem(target, force=force)
        before = _snapshot(base)
        try:
            refused = _refused_as_predicted(base, problem, lambda: replace_directory(target, fill, force=force))
        except KeyboardInterrupt:
            assert problem is None and fail
            assert _snapshot(base) == before  # the fresh directory removed, the target as it was
        else:
            assert refused or (problem is None and not fail)
        if problem is None and not fail:
            assert kind in ("missing", "empty-dir", "parent-missing") or (force and kind == "full-dir")
            assert sorted(p.name for p in Path(target).iterdir()) == ["a.txt"]
        assert _dev_null_intact()
        if kind in ("fifo", "socket", "chardev", "regular", "symlink-dangling", "empty-name", "parent-is-file", "proc",
                    "sys"):
            assert problem is not None


# --- every CLI command that writes, over every kind of target ------------------------------------------------

#: subcommand -> how to name a target with it (None: the command writes no file). Every subcommand the
#: parser knows must be here: a new one is classified (and, if it writes, tested below) by being added.
WRITERS: dict[str, Callable[[str, Path], list[str]] | None] = {
    "tune": lambda target, ck: ["tune", str(ck), "--out", target],
    "tiny-model": lambda target, ck: ["tiny-model", target],
    "new-plugin": lambda target, ck: ["new-plugin", "my_method", target],
    "demo": lambda target, ck: ["demo", "--keep", target],
    "list": None, "plugins": None, "rules": None, "explain": None, "validate": None, "doctor": None,
    "plan": None, "schema": None, "check-method": None,
}

#: Targets every writing command must refuse (demo --keep adds to an existing directory, so a full one is fine).
REFUSED = ("fifo", "socket", "chardev", "symlink-dangling", "symlink-dev", "parent-is-file", "empty-name", "proc",
           "sys")
#: Documented exceptions: `tune --out` replaces a symlink (the link, never what it names: docs/tune.md).
REPLACES_SYMLINKS = {"tune"}


def test_every_subcommand_is_classified() -> None:
    assert set(cli.subcommands()) == set(WRITERS), "classify the new subcommand in WRITERS (does it write a file?)"


def _tiny_checkpoint(base: Path) -> Path:
    ck = base / "ck"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({
        "model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2, "hidden_size": 64,
        "intermediate_size": 64, "num_hidden_layers": 1, "quantization_config": {"quant_method": "mxfp4"}}))
    return ck


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(sorted(c for c, w in WRITERS.items() if w is not None)),
       kind=st.sampled_from(REFUSED), as_json=st.booleans())
def test_every_writing_command_refuses_before_work(tmp_path_factory: pytest.TempPathFactory,
                                                   capsys: pytest.CaptureFixture[str], command: str, kind: str,
                                                   as_json: bool) -> None:
    if command in REPLACES_SYMLINKS and kind.startswith("symlink-"):
        kind = "fifo"
    base = tmp_path_factory.mktemp("cli")
    ck = _tiny_checkpoint(base)
    words = WRITERS[command]
    assert words is not None
    with _target(base, kind) as target:
        before = _snapshot(base)
        capsys.readouterr()
        status = cli.main([*words(target, ck), *(["--json"] if as_json else [])])
        out, err = capsys.readouterr()
        assert status in (1, 2), (command, kind, out, err)
        lines = [line for line in err.splitlines() if line.startswith(f"quantreg {command}:")]
        assert len(lines) == 1 and "Traceback" not in err, err
        if as_json:
            problems = json.loads(out)["problems"]
            assert problems and all(p["message"] for p in problems)
        assert _snapshot(base) == before
        assert _dev_null_intact()
