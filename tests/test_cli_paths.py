"""Every CLI path ends in a located line (and the envelope under --json) with exit 1/2, never a traceback.

Class 13 of docs/reliability.md. The property draws a subcommand, one of its arguments that name a
path (found in the parser by metavar, so a new command or path argument is covered by being
added; :func:`test_every_argument_is_classified` fails until a new argument is classified), and a
hostile value for it: a non-UTF-8 name (missing, or an existing file of garbage), ``/proc/x``,
``/sys/x``, a dangling symlink, ``''``, a FIFO, a directory. It runs ``quantreg.cli.main``
in-process with stdout and stderr as strict UTF-8 streams (the printer itself must not raise)
and checks the answer. The named examples of issue 34 are tests of their own below.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantreg import cli

#: Metavars of arguments that name a path.
PATH_METAVARS = {"FILE", "FILE.jsonl", "DIR", "MODEL_DIR", "TABLE"}
#: Metavars (or dests) of arguments that do not: a new argument must land in one of the two sets.
OTHER_ARGS = {"json", "device", "quant_format", "model_type", "no_vllm", "bf16", "force", "budget", "synthetic",
              "tokens", "name", "shape", "layer", "layers", "seed", "verbose", "allow_lossy", "planted"}
#: Commands that run vLLM or minutes of work when a path is accepted: drawn only with values they must refuse.
HEAVY_WHEN_ACCEPTED = {"check-method", "demo"}
ACCEPTED_BY_SOME = {"garbage-nonutf8", "missing-nonutf8", "directory"}
KINDS = ("missing-nonutf8", "garbage-nonutf8", "proc", "sys", "dangling", "empty", "fifo", "directory")
POSITIONAL_DEFAULTS = {"quant_format": "gpt_oss_mxfp4", "model_type": "gpt_oss", "device": "cpu",
                       "name": "mxfp4_reference"}
NONUTF8 = os.fsdecode(b"bad-\xff-name")


def _path_args() -> list[tuple[str, argparse.Action]]:
    out = []
    for name, parser in cli.subcommands().items():
        for action in parser._actions:
            if action.metavar in PATH_METAVARS:
                out.append((name, action))
    return out


def test_every_argument_is_classified() -> None:
    for name, parser in cli.subcommands().items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.metavar in PATH_METAVARS or action.dest in OTHER_ARGS, (
                f"{name} {action.dest}: classify it (PATH_METAVARS if it names a path, else OTHER_ARGS)")


def _value(base: Path, kind: str) -> str:
    if kind == "missing-nonutf8":
        return str(base / NONUTF8)
    if kind == "garbage-nonutf8":
        path = base / NONUTF8
        path.write_bytes(b"\xff\xfe: [\n\x00")
        return str(path)
    if kind in ("proc", "sys"):
        return f"/{kind}/quantreg-test-x"
    if kind == "dangling":
        (base / "dangling").symlink_to(base / "nowhere")
        return str(base / "dangling")
    if kind == "empty":
        return ""
    if kind == "fifo":
        os.mkfifo(base / "fifo")
        return str(base / "fifo")
    (base / "dir").mkdir()
    return str(base / "dir")


def _argv(command: str, action: argparse.Action, value: str, base: Path) -> list[str]:
    """``command`` with ``value`` for ``action`` and harmless defaults for its other required positionals."""
    words = [command]
    for other in cli.subcommands()[command]._actions:
        if other.option_strings:
            continue
        if other.dest == action.dest:
            words.append(value)
        elif other.nargs in ("?", "*"):
            continue
        elif other.metavar == "MODEL_DIR":
            (base / "model").mkdir(exist_ok=True)  # an empty directory: not a checkpoint, refused fast
            words.append(str(base / "model"))
        else:
            words.append(POSITIONAL_DEFAULTS[other.dest])
    if action.option_strings:
        words += [action.option_strings[0], value]
    if command == "tune" and action.dest != "out":
        words += ["--out", str(base / "tuned.yaml")]
    return words


class _Kept(io.BytesIO):
    def close(self) -> None:  # the text wrapper closes its buffer when collected; keep the bytes readable
        pass


@contextlib.contextmanager
def _strict_streams() -> Iterator[tuple[io.BytesIO, io.BytesIO]]:
    """stdout/stderr as strict UTF-8 text streams over bytes (what a C.UTF-8 terminal or pipe gives)."""
    out, err = _Kept(), _Kept()
    saved = sys.stdout, sys.stderr
    sys.stdout = io.TextIOWrapper(out, encoding="utf-8", errors="strict", write_through=True)
    sys.stderr = io.TextIOWrapper(err, encoding="utf-8", errors="strict", write_through=True)
    try:
        yield out, err
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved


def run(argv: list[str]) -> tuple[int, str, str]:
    with _strict_streams() as (out, err):
        try:
            status = cli.main(argv)
        except SystemExit as exc:  # argparse's usage errors
            status = int(exc.code or 0)
    return status, out.getvalue().decode("utf-8"), err.getvalue().decode("utf-8")


def _check(status: int, out: str, err: str, as_json: bool, what: str) -> None:
    assert status in (0, 1, 2), what
    assert "Traceback" not in err and "Traceback" not in out, (what, err[-2000:])
    if status and not as_json:
        assert [line for line in (out + err).splitlines() if line.strip()], (what, "a failure says why")
    if as_json:
        data = json.loads(out)
        assert {"problems", "left_out", "vllm_would_refuse"} <= set(data), what
        if status:
            assert data["problems"] or data["vllm_would_refuse"] or data.get("ok") is False, (what, data)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(_path_args()), kind=st.sampled_from(KINDS), as_json=st.booleans())
def test_every_path_argument_ends_in_a_line(tmp_path_factory: pytest.TempPathFactory,
                                            which: tuple[str, argparse.Action], kind: str, as_json: bool) -> None:
    command, action = which
    if command in HEAVY_WHEN_ACCEPTED and kind in ACCEPTED_BY_SOME:
        kind = "proc"
    base = tmp_path_factory.mktemp("paths")
    argv = _argv(command, action, _value(base, kind), base) + (["--json"] if as_json else [])
    status, out, err = run(argv)
    _check(status, out, err, as_json, f"{argv!r} -> {status}")


# --- the named examples (issue 34) ----------------------------------------------------------------------------

@pytest.mark.parametrize("as_json", [False, True])
def test_new_plugin_and_tiny_model_on_proc_sys_and_dangling(tmp_path: Path, as_json: bool) -> None:
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for argv in (["new-plugin", "my_method", "/proc/x"], ["new-plugin", "my_method", "/sys/x"],
                 ["new-plugin", "my_method", str(tmp_path / "dangling")], ["tiny-model", "/proc/x"],
                 ["tiny-model", ""]):
        status, out, err = run(argv + (["--json"] if as_json else []))
        assert status in (1, 2) and len(err.strip().splitlines()) == 1, (argv, err)
        _check(status, out, err, as_json, repr(argv))
    assert not (tmp_path / "nowhere").exists()


def test_tiny_model_empty_name_writes_nothing_into_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    status, _, err = run(["tiny-model", ""])
    assert status == 2 and "empty name" in err and list(tmp_path.iterdir()) == []


def test_a_non_utf8_name_reaches_a_strict_stdout_escaped(tmp_path: Path) -> None:
    bad = tmp_path / NONUTF8
    bad.write_text("version: 1\nrules: []\n")
    status, out, err = run(["validate", str(bad)])
    assert status == 0 and "Traceback" not in err
    status, out, err = run(["validate", "--json", str(bad)])
    assert status == 0 and json.loads(out)["files"]
    status, out, err = run(["explain", NONUTF8, "gpt_oss", "cpu"])
    assert status in (0, 1) and "\\udcff" in out + err and "Traceback" not in err


def test_doctor_json_decisions_missing_is_in_the_problems(tmp_path: Path) -> None:
    status, out, _ = run(["doctor", "--json", "--decisions", str(tmp_path / "missing.jsonl")])
    problems = json.loads(out)["problems"]
    assert status == 1 and any("missing.jsonl" in p["text"] and "no such file" in p["text"] for p in problems)


@pytest.mark.parametrize("flag", ["--js", "--jso", "--json"])
def test_a_json_prefix_answers_usage_errors_in_json(flag: str) -> None:
    status, out, err = run(["explain", flag, "only-one-argument"])
    assert status == 2 and json.loads(out)["problems"][0]["key"] == "usage" and "usage:" in err


def test_an_unexpected_exception_is_one_located_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(args: argparse.Namespace) -> int:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(cli, "cmd_schema", boom)
    for as_json in (False, True):
        status, out, err = run(["schema", *(["--json"] if as_json else [])])
        assert status == 2 and err.count("\n") == 1 and "internal error: RuntimeError: boom" in err
        assert "(at test_cli_paths.py:" in err
        _check(status, out, err, as_json, "schema")
