"""``quantreg validate`` on the bad-table corpus, through the real console script.

Each file in ``tests/bad_tables/`` holds one fault; ``expected.yaml`` says which line and key the
message must name. The subprocesses run concurrently (one per file) to keep the suite fast.
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import BAD_TABLES, GOOD_TABLES, QUANTREG, ROOT, run_cli

pytestmark = pytest.mark.usefixtures("clean_env")

EXPECTED: dict[str, dict[str, Any]] = yaml.safe_load((BAD_TABLES / "expected.yaml").read_text(encoding="utf-8"))


def files_for(name: str) -> list[Path]:
    return [BAD_TABLES / f for f in EXPECTED[name].get("with", [])] + [BAD_TABLES / name]


@pytest.fixture(scope="module")
def results() -> dict[str, subprocess.CompletedProcess[str]]:
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = {name: pool.submit(run_cli, "validate", *map(str, files_for(name))) for name in EXPECTED}
        return {name: f.result() for name, f in futures.items()}


def test_corpus_is_large_and_fully_annotated() -> None:
    on_disk = {p.name for p in BAD_TABLES.iterdir()} - {"expected.yaml"}
    companions = {f for e in EXPECTED.values() for f in e.get("with", [])}
    assert on_disk == set(EXPECTED) | companions
    assert len(EXPECTED) >= 25
    for name, entry in EXPECTED.items():
        assert {"line", "key", "fragment", "schema"} <= set(entry), name


def test_quantreg_is_the_venv_console_script() -> None:
    assert QUANTREG.exists(), f"no console script at {QUANTREG}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_validate_rejects(name: str, results: dict[str, subprocess.CompletedProcess[str]]) -> None:
    entry = EXPECTED[name]
    out = results[name]
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "Traceback" not in text
    path = BAD_TABLES / name
    prefix = f"{path}:{entry['line']}: " + (f"{entry['key']}: " if entry["key"] is not None else "")
    lines = [line for line in out.stdout.splitlines() if line.startswith(prefix)]
    assert lines, f"no line starting with {prefix!r} in:\n{text}"
    assert any(entry["fragment"] in line for line in lines), f"{entry['fragment']!r} not in {lines}"
    for other in entry.get("names", []):
        file, _, line = other.rpartition(":")
        assert any(f"{BAD_TABLES / file}:{line}" in x for x in lines), f"{other} not named in {lines}"


def test_companion_tables_are_valid_alone() -> None:
    companions = sorted({f for e in EXPECTED.values() for f in e.get("with", [])})
    out = run_cli("validate", *(str(BAD_TABLES / f) for f in companions))
    assert out.returncode == 0, out.stdout + out.stderr


def test_all_bad_tables_at_once_report_every_file() -> None:
    names = sorted(EXPECTED)
    companions = sorted({f for e in EXPECTED.values() for f in e.get("with", [])})
    out = run_cli("validate", "--json", *(str(BAD_TABLES / n) for n in companions + names))
    assert out.returncode == 1
    data = json.loads(out.stdout)
    assert data["ok"] is False
    for name in names:
        assert any(p["text"].startswith(f"{BAD_TABLES / name}:") for p in data["problems"]), name


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_validate_missing_path_and_directory(kind: str, tmp_path: Path) -> None:
    target = tmp_path / "nope.yaml" if kind == "missing" else tmp_path
    out = run_cli("validate", str(target))
    assert out.returncode == 1
    assert "Traceback" not in out.stdout + out.stderr
    expected = "no such file" if kind == "missing" else "is a directory; expected a YAML file"
    assert out.stdout.strip() == f"{target}: {expected}"


def test_validate_good_tables_exit_zero() -> None:
    goods = [str(p) for p in sorted(GOOD_TABLES.glob("*.yaml"))]
    out = run_cli("validate", *goods)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == f"ok: {len(goods)} table(s) valid"
    out = run_cli("validate", str(ROOT / "registry.yaml"))
    assert out.returncode == 0, out.stdout + out.stderr


def test_validate_json_for_a_bad_table() -> None:
    out = run_cli("validate", "--json", str(BAD_TABLES / "08_version_2.yaml"))
    assert out.returncode == 1
    data = json.loads(out.stdout)
    path = str(BAD_TABLES / "08_version_2.yaml")
    message = "unsupported schema version 2; this quantreg reads version 1"
    assert data == {  # the envelope: problems as objects (with the terminal's text), left_out, vllm_would_refuse
        "ok": False,
        "problems": [{"path": path, "line": 2, "key": "version", "message": message,
                      "text": f"{path}:2: version: {message}"}],
        "files": [path],
        "warnings": [],
        "deprecations": [],
        "left_out": [],
        "vllm_would_refuse": None,
    }
