"""``quantreg tiny-model DIR``: never writes outside what the user named (issue 21 class 8).

Real CLI in a subprocess (torch writes the checkpoint), with a timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("safetensors")


def tiny(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "QUANTREG_CACHE_DIR": "off"}
    return subprocess.run([sys.executable, "-m", "quantreg", "tiny-model", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


def test_refuses_an_existing_file_and_a_non_empty_directory_and_writes_nothing(tmp_path: Path) -> None:
    existing = tmp_path / "a-file"
    existing.write_text("keep me")
    out = tiny(str(existing), cwd=tmp_path)
    assert out.returncode == 2 and "is an existing file" in out.stderr and "Traceback" not in out.stderr
    assert existing.read_text() == "keep me"

    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text("{}")
    out = tiny(str(full), "--json", cwd=tmp_path)
    [problem] = json.loads(out.stdout)["problems"]  # the envelope's object, located at the directory
    assert out.returncode == 2 and "pass --force" in problem["message"] and problem["path"] == str(full)
    assert sorted(p.name for p in full.iterdir()) == ["config.json"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind


def test_force_replaces_atomically_without_following_symlinks_out(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.json"
    victim.write_text("untouched")
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").symlink_to(victim)  # a planted symlink inside DIR
    (target / "link-dir").symlink_to(outside)
    out = tiny(str(target), "--force", "--bf16", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert victim.read_text() == "untouched" and sorted(p.name for p in outside.iterdir()) == ["victim.json"]
    config = target / "config.json"
    assert not config.is_symlink() and json.loads(config.read_text())["model_type"] == "gpt_oss"
    assert not (target / "link-dir").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_an_empty_or_new_directory_is_written(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for name in ("empty", "new/nested"):
        out = tiny(name, "--bf16", "--json", cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "model.safetensors" in json.loads(out.stdout)["files"]
