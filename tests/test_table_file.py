"""quantreg.table.file: reading a table file (``read_table`` / ``parse_table``) never crashes, hangs or
reads without bound, and every fault is a located problem.

Only regular files, never more than the cap + 1 bytes, every path error located; the construction corpus
(bad_tables/63-78) through ``quantreg validate --json`` and a lenient ``register()`` in a fresh
interpreter; random documents and random bytes; non-ASCII model types accepted, non-names refused.

History (issue 24 class 5: tests by module, not by issue): most of this file was
tests/test_containment_loader.py (issue 12, loader classes) (classes 2, 3 and the loader part of 10),
renamed here; the random-document and 50 MB tests came from tests/test_hardening.py (strict vs lenient,
plugin fault isolation, security).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import BAD_TABLES, QUANTREG, run_cli, run_register
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantreg import Registry
from quantreg.table.file import Tier, parse_table, read_table

pytestmark = pytest.mark.usefixtures("clean_env")


# -- from test_containment_loader.py (issue 12, loader classes) -------------------------------


EXPECTED: dict[str, dict[str, Any]] = yaml.safe_load((BAD_TABLES / "expected.yaml").read_text(encoding="utf-8"))


CONSTRUCTION = sorted(n for n in EXPECTED if 63 <= int(n[:2]) <= 78)


def assert_located_only(problems: list[str], path: str) -> None:
    """Every problem names the file (and a line when it has one), on one line, with no traceback."""
    assert problems
    for text in problems:
        assert text.startswith(path), text
        assert "\n" not in text and "Traceback" not in text, text


def test_construction_corpus_is_there() -> None:
    assert len(CONSTRUCTION) == 16


@pytest.mark.parametrize("name", CONSTRUCTION)
def test_validate_json_reports_construction_faults(name: str) -> None:
    path = str(BAD_TABLES / name)
    out = run_cli("validate", "--json", path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    data = json.loads(out.stdout)
    assert data["ok"] is False
    texts = [p["text"] for p in data["problems"]]
    assert_located_only(texts, path)
    assert all(p["path"] == path and isinstance(p["line"], int) for p in data["problems"]), data["problems"]
    assert any(p.startswith(f"{path}:{EXPECTED[name]['line']}: ") for p in texts), texts


def test_lenient_register_survives_every_construction_fault() -> None:
    paths = [str(BAD_TABLES / n) for n in CONSTRUCTION]
    out = run_register(paths)
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout.splitlines()[-1])
    assert data["raised"] is None and data["strict"] is False
    assert data["tables"] == [t for t in data["tables"] if t not in paths]  # every bad file left out whole
    for path in paths:
        assert any(p.startswith(f"{path}:") for p in data["problems"]), path


def test_strict_register_raises_one_quantreg_error() -> None:
    out = run_register([str(BAD_TABLES / "68_options_nested_600.yaml")], QUANTREG_STRICT="1")
    assert out.returncode == 3, out.stdout + out.stderr
    data = json.loads(out.stdout.splitlines()[-1])
    assert data["raised"] == "QuantregError"
    assert "68_options_nested_600.yaml:5: nested more than 64 levels deep" in data["message"]


@settings(max_examples=100, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=400) | st.lists(st.sampled_from([b"version: 1\n", b"rules:\n", b"- ", b"[", b"{", b"]",
                                                           b"!!int ", b"&a ", b"*a", b"\xff", b"\x00", b"\t", b"\n",
                                                           b"    method: vllm\n"]), max_size=50).map(b"".join))
def test_arbitrary_bytes_in_a_table_file_give_located_problems_only(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "bytes.yaml"
    path.write_bytes(data)
    table, problems, _ = read_table(path, Tier.USER)
    assert (table is None) == bool(problems)
    for problem in problems:
        assert str(problem).startswith(str(path)) and "\n" not in str(problem)
    registry = Registry.build(env={"QUANTREG_CONFIG": str(path)}, entry_points=False)  # lenient: returns
    assert (str(path) in [t.path for t in registry.tables]) == (table is not None and not registry.problems)


def test_validate_exits_0_or_1_with_located_lines_on_random_bytes(tmp_path: Path) -> None:
    import random

    rng = random.Random(12)
    paths = []
    for i in range(12):
        path = tmp_path / f"r{i}.yaml"
        chunks = [b"version: 1\n", b"rules:\n", b"  - match: {}\n", b"    method: vllm\n", b"!!int x\n", b"[" * 900,
                  bytes(rng.randrange(256) for _ in range(20))]
        path.write_bytes(b"".join(rng.choice(chunks) for _ in range(8)))
        paths.append(str(path))
    out = run_cli("validate", "--json", *paths)
    assert out.returncode in (0, 1), out.stderr
    data = json.loads(out.stdout)
    for problem in data["problems"]:
        assert any(problem["text"].startswith(p + ":") for p in paths), problem


def _special_paths(tmp_path: Path) -> dict[str, str]:
    fifo = tmp_path / "table.fifo"
    os.mkfifo(fifo)
    return {"fifo": str(fifo), "dev_zero": "/dev/zero", "dev_null": "/dev/null"}


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "dev_null"])
def test_read_table_refuses_non_regular_files_at_once(tmp_path: Path, kind: str) -> None:
    path = _special_paths(tmp_path)[kind]
    table, problems, _ = read_table(path, Tier.USER)
    assert table is None
    assert [str(p) for p in problems] == [f"{path}: is not a regular file "
                                          f"({'a FIFO' if kind == 'fifo' else 'a character device'}); "
                                          "expected a YAML file"]


def test_validate_and_register_do_not_hang_on_a_fifo_or_dev_zero(tmp_path: Path) -> None:
    paths = _special_paths(tmp_path)
    out = run_cli("validate", "--json", paths["fifo"], paths["dev_zero"])
    assert out.returncode == 1
    data = json.loads(out.stdout)
    texts = sorted(p["text"] for p in data["problems"])
    assert texts == sorted(f"{p}: is not a regular file ({w}); expected a YAML file"
                           for p, w in ((paths["fifo"], "a FIFO"), (paths["dev_zero"], "a character device")))


def test_lenient_register_does_not_hang_on_a_fifo_or_dev_zero(tmp_path: Path) -> None:
    paths = _special_paths(tmp_path)
    reg = run_register([paths["fifo"], paths["dev_zero"]], timeout=20)
    assert reg.returncode == 0, reg.stderr
    assert len(json.loads(reg.stdout.splitlines()[-1])["problems"]) == 2


def test_dev_stdin_on_a_silent_pipe_does_not_hang() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "quantreg", "validate", "/dev/stdin"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**{k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")},
                                 "QUANTREG_PLUGINS": ""})
    try:
        stdout, stderr = proc.communicate(timeout=60)  # stdin is never written nor closed before the answer
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr
    assert "/dev/stdin: is not a regular file (a FIFO); expected a YAML file" in stdout


def test_oversized_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    from quantreg.table.located import MAX_BYTES

    path = tmp_path / "big.yaml"
    with open(path, "wb") as f:
        f.truncate(MAX_BYTES + 1)  # sparse: nothing to read anyway
    _, problems, _ = read_table(path, Tier.USER)
    assert [p.message for p in problems] == [f"file is {MAX_BYTES + 1} bytes; a table may have at most {MAX_BYTES}"]


def test_read_stops_at_cap_plus_one_when_the_size_lies(tmp_path: Path) -> None:
    from quantreg.table.located import ReadRefused, read_regular_file

    path = tmp_path / "t.yaml"
    path.write_bytes(b"x" * 101)
    with pytest.raises(ReadRefused, match="file is 101 bytes; a table may have at most 100"):
        read_regular_file(path, 100)
    assert read_regular_file(path, 101) == b"x" * 101


@pytest.mark.parametrize("kind", ["nul", "too_long", "long_component"])
def test_path_errors_are_located_problems(tmp_path: Path, kind: str) -> None:
    path = {"nul": f"{tmp_path}/a\0b.yaml", "too_long": str(tmp_path / ("d/" * 3000)) + "t.yaml",
            "long_component": str(tmp_path / ("x" * 300 + ".yaml"))}[kind]
    table, problems, _ = read_table(path, Tier.USER)
    assert table is None and len(problems) == 1
    expected = {"nul": "cannot read: the path contains a NUL character", "too_long": "cannot read: File name too long",
                "long_component": "cannot read: File name too long"}[kind]
    assert problems[0].message == expected


def test_lenient_build_with_a_nul_in_a_table_path_returns(tmp_path: Path) -> None:
    registry = Registry.build(config=[f"{tmp_path}/a\0b.yaml"], entry_points=False)
    assert [p.message for p in registry.problems] == ["cannot read: the path contains a NUL character"]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_unreadable_parent_directory_is_a_located_problem(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "t.yaml").write_text("version: 1\nrules: []\n")
    locked.chmod(0)
    try:
        _, problems, _ = read_table(locked / "t.yaml", Tier.USER)
    finally:
        locked.chmod(0o755)
    assert [p.message for p in problems] == ["cannot read: Permission denied"]


def test_file_identity_is_the_same_for_a_hard_link_and_a_symlink(tmp_path: Path) -> None:
    from quantreg.table.file import file_identity

    first = tmp_path / "t.yaml"
    first.write_text("version: 1\nrules: []\n")
    os.link(first, tmp_path / "hard.yaml")
    os.symlink(first, tmp_path / "soft.yaml")
    other = tmp_path / "other.yaml"
    other.write_text("version: 1\nrules: []\n")
    ident = file_identity(first)
    assert ident is not None
    assert file_identity(tmp_path / "hard.yaml") == ident == file_identity(tmp_path / "soft.yaml")
    assert file_identity(other) != ident
    assert file_identity(tmp_path / "missing.yaml") is None and file_identity("a\0b") is None


def test_headers_come_only_from_regular_files(tmp_path: Path) -> None:
    """The mode reads ``strict:`` from table headers, which are read like tables: never blocking."""
    paths = _special_paths(tmp_path)
    assert read_table(paths["fifo"], Tier.USER)[2] is None  # at once: no writer is ever coming
    assert read_table(paths["dev_zero"], Tier.USER)[2] is None
    strict = tmp_path / "s.yaml"
    strict.write_text("version: 1\nstrict: true\nrules: 3\n")
    table, problems, header = read_table(strict, Tier.USER)
    assert table is None and problems and header is not None and header.strict is True


@pytest.mark.parametrize("value", ["modèle_moe", "模型", "Ελληνικά-2", "gpt_oss"])
def test_non_ascii_model_types_are_accepted_verbatim(value: str, tmp_path: Path) -> None:
    from quantreg.keys import Key
    from quantreg.table.schema import table_schema

    path = tmp_path / "u.yaml"
    path.write_text(f"version: 1\nrules:\n  - match: {{model_type: {value}}}\n    method: vllm\n    priority: 3\n",
                    encoding="utf-8")
    table, problems, _ = read_table(path, Tier.USER)
    assert problems == [] and table is not None and table.rules[0].match.model_type == (value,)
    registry = Registry.build(config=[path], entry_points=False)
    chosen = registry.resolve(Key("fp8", value, "cpu")).rule
    assert chosen is not None and (chosen.path, chosen.line, chosen.match) == (str(path), 3, table.rules[0].match)
    import jsonschema

    assert jsonschema.Draft202012Validator(table_schema()).is_valid(yaml.safe_load(path.read_text(encoding="utf-8")))
    out = run_cli("validate", str(path))
    assert out.returncode == 0, out.stdout


@pytest.mark.parametrize("value", ["modèle moe", "a\u00a0b", "x\u200by", "é\u0301", "\u2028"])
def test_non_names_stay_refused_whatever_the_script(value: str) -> None:
    text = f"version: 1\nrules:\n  - match: {{model_type: {json.dumps(value)}}}\n    method: vllm\n"
    _, problems, _ = parse_table(text, "t.yaml", Tier.USER)
    assert problems and "\n" not in str(problems[0]) and "\u2028" not in str(problems[0])


def test_method_names_stay_ascii() -> None:
    _, problems, _ = parse_table("version: 1\nrules:\n  - match: {}\n    method: méthode\n", "t.yaml", Tier.USER)
    assert [p.key for p in problems] == ["rules[0].method"]


# -- from test_hardening.py (strict vs lenient, fault isolation, security) --------------------


def test_fifty_megabyte_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    with big.open("wb") as f:
        f.truncate(50 << 20)  # sparse: 50 MB on paper, nothing to read if we refuse first
    out = subprocess.run([str(QUANTREG), "validate", str(big)], capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stdout.strip() == f"{big}: file is {50 << 20} bytes; a table may have at most {4 << 20}"


YAML_TOKENS = ["version:", "rules:", "- ", "match:", "method:", "options:", "priority:", "strict:", "{", "}",
               "[", "]", ",", ":", "\n", "  ", "\t", "'", '"', "&a", "*a", "!!python/object", "!!str", "<<",
               "*", "cpu", "hpu", "vllm", "1", "-1", "2.5", "null", "true", "~", "#", "---", "...", "|", ">",
               "\x00", "\u00e9", "methods:", "allow_import_targets:", "target:", "os:system"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=200), st.lists(st.sampled_from(YAML_TOKENS), max_size=60).map("".join)))
def test_loader_never_raises_on_random_documents(text: str) -> None:
    table, problems, _ = parse_table(text, "fuzz.yaml", Tier.USER)
    assert (table is None) == bool(problems)  # a document is either a table or a list of located problems
    for problem in problems:
        assert str(problem).startswith("fuzz.yaml")
        assert problem.line is None or problem.line >= 1
