"""Issue 12, loader classes: nothing a table file holds can crash, hang or blow up a loader.

Class 2 (construction faults and nesting), 3 (only regular files, bounded reads), 4 (costs),
11 (cache integrity) and the loader parts of 10 (alias lines, escaped control characters,
non-UTF-8 paths, non-ASCII names). Each class is checked through ``quantreg validate`` (also
``--json``) as a subprocess and through a lenient ``register()`` in a fresh interpreter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import BAD_TABLES, run_cli, run_register
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantreg.located import MAX_DEPTH
from quantreg.registry import Registry
from quantreg.tables import Layer, parse_table, read_table

pytestmark = pytest.mark.usefixtures("clean_env")

EXPECTED: dict[str, dict[str, Any]] = yaml.safe_load((BAD_TABLES / "expected.yaml").read_text(encoding="utf-8"))
CONSTRUCTION = sorted(n for n in EXPECTED if 63 <= int(n[:2]) <= 78)


def assert_located_only(problems: list[str], path: str) -> None:
    """Every problem names the file (and a line when it has one), on one line, with no traceback."""
    assert problems
    for text in problems:
        assert text.startswith(path), text
        assert "\n" not in text and "Traceback" not in text, text


# -- class 2: construction faults, huge integers, deep nesting --------------------------------

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
    assert_located_only(data["problems"], path)
    assert any(p.startswith(f"{path}:{EXPECTED[name]['line']}: ") for p in data["problems"]), data["problems"]


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


@pytest.mark.parametrize("depth", [MAX_DEPTH - 1, MAX_DEPTH])
def test_nesting_up_to_the_bound_is_accepted(depth: int) -> None:
    # root mapping (1) > rules (2) > rule (3) > options (4) > ... so options may nest depth - 4 more levels
    inner = "{a: " * (depth - 4) + "1" + "}" * (depth - 4)
    text = f"version: 1\nrules:\n  - match: {{}}\n    method: vllm\n    options: {{k: {inner}}}\n"
    table, problems = parse_table(text, "deep.yaml", Layer.USER)
    assert table is not None and problems == [], problems


def test_one_level_past_the_bound_is_a_located_problem() -> None:
    inner = "[" * (MAX_DEPTH - 3) + "]" * (MAX_DEPTH - 3)  # rule (3) + options value list levels
    text = f"version: 1\nrules:\n  - match: {{}}\n    method: vllm\n    options: {{k: {inner}}}\n"
    table, problems = parse_table(text, "deep.yaml", Layer.USER)
    assert table is None
    assert [(p.line, p.message) for p in problems] == [(5, f"nested more than {MAX_DEPTH} levels deep; "
                                                           "a table needs far fewer")]


def test_large_but_printable_integers_are_still_values() -> None:
    text = "version: 1\nrules:\n  - match: {}\n    method: vllm\n    priority: " + "9" * 300 + "\n"
    table, problems = parse_table(text, "big.yaml", Layer.USER)
    assert problems == [] and table is not None
    assert table.rules[0].priority == int("9" * 300)


# -- fuzzing: tagged scalars, huge integers, deep nesting, arbitrary bytes -------------------

TAGS = ["!!int", "!!float", "!!bool", "!!null", "!!str", "!!map", "!!seq", "!!binary", "!!timestamp", "!custom", "!"]
SCALARS = ["abc", "maybe", "1", "1.5", "0x" + "f" * 4000, "9" * 5000, "", "~", ".nan", "-.inf", "1e", "0o7", "yes"]


def _tagged() -> st.SearchStrategy[str]:
    return st.builds(lambda t, v: f"{t} {json.dumps(v)}" if v in ("", "~") else f"{t} {v}",
                     st.sampled_from(TAGS), st.sampled_from(SCALARS))


def _nested() -> st.SearchStrategy[str]:
    return st.builds(lambda n, kind: ("[" * n + "]" * n) if kind else ("{a: " * n + "1" + "}" * n),
                     st.integers(0, 1500), st.booleans())


values = st.one_of(_tagged(), _nested(), st.sampled_from(SCALARS))
field = st.sampled_from(["priority", "note", "options", "method", "match", "strict", "version"])


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(field, values), min_size=1, max_size=4))
def test_tagged_huge_and_deep_values_give_located_problems_only(entries: list[tuple[str, str]]) -> None:
    top = [f"{k}: {v}" for k, v in entries if k in ("strict", "version")]
    rule = [f"    {k}: {v}" for k, v in entries if k not in ("strict", "version")]
    text = "\n".join(["version: 1", *top, "rules:", "  - match: {}", "    method: vllm", *rule]) + "\n"
    table, problems = parse_table(text, "fuzz.yaml", Layer.USER)
    assert (table is None) == bool(problems)
    for problem in problems:
        assert str(problem).startswith("fuzz.yaml") and "\n" not in str(problem)
        assert problem.line is None or problem.line >= 1


@settings(max_examples=100, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=400) | st.lists(st.sampled_from([b"version: 1\n", b"rules:\n", b"- ", b"[", b"{", b"]",
                                                           b"!!int ", b"&a ", b"*a", b"\xff", b"\x00", b"\t", b"\n",
                                                           b"    method: vllm\n"]), max_size=50).map(b"".join))
def test_arbitrary_bytes_in_a_table_file_give_located_problems_only(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "bytes.yaml"
    path.write_bytes(data)
    table, problems = read_table(path, Layer.USER)
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
        assert any(problem.startswith(p + ":") for p in paths), problem
