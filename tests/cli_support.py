"""Fixtures for the ``quantreg`` command's tests (test_cli*.py, test_doctor.py): the CLI called
in-process with its exit code and output, and three real table files (user, run1, run2); conftest.py
makes ``cli`` and ``tables`` reachable. The autouse fixture keeps the venv's installed plugins out of
the answers; a module imports it to opt in."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from quantreg.cli import main


@pytest.fixture(autouse=True)
def no_installed_plugins(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep whatever plugins are installed in this venv out of the answers (after clean_env)."""
    monkeypatch.setenv("QUANTREG_PLUGINS", "")


Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Run:
    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def cli_json(cli: Run, *args: str) -> Any:
    code, out, err = cli(*args, "--json")
    assert code == 0, out + err
    return json.loads(out)


@pytest.fixture
def tables(table: Callable[[str, str], Path]) -> dict[str, Path]:
    return {
        "user": table("user.yaml", """
            version: 1
            rules:
              - match: {quant_format: fp8}
                method: vllm
                note: from the user file
        """),
        "run1": table("run1.yaml", """
            version: 1
            rules:
              - match: {quant_format: fp8, device: cpu}
                method: [vllm]
                options: {chunk: 2}
        """),
        "run2": table("run2.yaml", """
            version: 1
            rules:
              - match: {model_type: llama, device: cpu}
                method: vllm
                priority: 5
        """),
    }
