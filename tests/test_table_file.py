"""Issue 12, loader classes: nothing a table file holds can crash, hang or blow up a loader.

Class 2 (construction faults and nesting), 3 (only regular files, bounded reads), 4 (costs),
11 (cache integrity) and the loader parts of 10 (alias lines, escaped control characters,
non-UTF-8 paths, non-ASCII names). Each class is checked through ``quantreg validate`` (also
``--json``) as a subprocess and through a lenient ``register()`` in a fresh interpreter.
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
from core_support import BAD_TABLES, run_cli, run_register
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantreg.registry import Registry
from quantreg.table.file import Layer, parse_table, read_table
from quantreg.table.located import MAX_DEPTH

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


@pytest.mark.parametrize("depth", [MAX_DEPTH - 1, MAX_DEPTH])
def test_nesting_up_to_the_bound_is_accepted(depth: int) -> None:
    # root mapping (1) > rules (2) > rule (3) > options (4) > k's value (5) ...; the scalar counts as a level
    inner = "{a: " * (depth - 5) + "1" + "}" * (depth - 5)
    text = f"version: 1\nrules:\n  - match: {{}}\n    method: vllm\n    options: {{k: {inner}}}\n"
    table, problems, _ = parse_table(text, "deep.yaml", Layer.USER)
    assert table is not None and problems == [], problems


@pytest.mark.parametrize("text", [
    "a: &a [1, {b: 2}]\nc: *a\nd:\n  - *a\n  - x\n",
    "version: 1\nrules:\n  - &r {match: {device: cpu}, method: vllm}\n  - *r\n",
    "a: &x 1\nb: [*x, *x]\nc: &y {k: *x}\nd: *y\n",
    "a: &a [" + ", ".join(["1"] * 100) + "]\nb: [" + ", ".join(["*a"] * 2001) + "]\n",  # a bomb
    "a: &a " + "[" * 40 + "]" * 40 + "\nb: " + "[" * 30 + "*a" + "]" * 30 + "\n",  # too deep through an alias
    "a: &a 1\nb: &a 2\n",  # duplicate anchor
    "a: &a [*a]\n",  # recursive
])
def test_fast_path_aliases_equal_the_reference_path(text: str) -> None:
    from quantreg.table import yamlfile

    def shape(v: Any) -> Any:
        if isinstance(v, dict):
            return ("d", v.line, dict(v.key_lines), {k: shape(x) for k, x in v.items()})  # type: ignore[attr-defined]
        if isinstance(v, list):
            return ("l", v.line, list(v.item_lines), [shape(x) for x in v])  # type: ignore[attr-defined]
        return v

    def outcome(parse: Any) -> Any:
        try:
            return shape(parse(text))
        except yamlfile.YamlError as exc:
            return ("error", exc.line, exc.key, exc.message)

    assert outcome(yamlfile.parse) == outcome(yamlfile._parse_pure)


def test_one_level_past_the_bound_is_a_located_problem() -> None:
    inner = "[" * (MAX_DEPTH - 3) + "]" * (MAX_DEPTH - 3)  # rule (3) + options value list levels
    text = f"version: 1\nrules:\n  - match: {{}}\n    method: vllm\n    options: {{k: {inner}}}\n"
    table, problems, _ = parse_table(text, "deep.yaml", Layer.USER)
    assert table is None
    assert [(p.line, p.message) for p in problems] == [(5, f"nested more than {MAX_DEPTH} levels deep; "
                                                           "a table needs far fewer")]


def test_large_but_printable_integers_are_still_values() -> None:
    text = "version: 1\nrules:\n  - match: {}\n    method: vllm\n    priority: " + "9" * 300 + "\n"
    table, problems, _ = parse_table(text, "big.yaml", Layer.USER)
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
    table, problems, _ = parse_table(text, "fuzz.yaml", Layer.USER)
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
    table, problems, _ = read_table(path, Layer.USER)
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


# -- class 3: only regular files, never more than cap + 1 bytes, every path error located -----

def _special_paths(tmp_path: Path) -> dict[str, str]:
    fifo = tmp_path / "table.fifo"
    os.mkfifo(fifo)
    return {"fifo": str(fifo), "dev_zero": "/dev/zero", "dev_null": "/dev/null"}


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "dev_null"])
def test_read_table_refuses_non_regular_files_at_once(tmp_path: Path, kind: str) -> None:
    path = _special_paths(tmp_path)[kind]
    table, problems, _ = read_table(path, Layer.USER)
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
    _, problems, _ = read_table(path, Layer.USER)
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
    table, problems, _ = read_table(path, Layer.USER)
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
        _, problems, _ = read_table(locked / "t.yaml", Layer.USER)
    finally:
        locked.chmod(0o755)
    assert [p.message for p in problems] == ["cannot read: Permission denied"]


def test_a_fifo_at_the_cache_entry_path_does_not_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from quantreg.table import cache as tablecache

    monkeypatch.setenv(tablecache.ENV, str(tmp_path / "cache"))
    text = "version: 1\nrules:\n  - match: {}\n    method: vllm\n"
    entry = tablecache.entry_path(text)
    assert entry is not None
    entry.parent.mkdir(parents=True)
    os.mkfifo(entry)
    os.mkfifo(entry.with_name(f".{entry.name}.{os.getpid()}.tmp"))  # and at the temporary name a writer uses
    table, problems, _ = parse_table(text, "pkg.yaml", Layer.DEFAULT)
    assert problems == [] and table is not None and len(table.rules) == 1


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
    assert read_table(paths["fifo"], Layer.USER)[2] is None  # at once: no writer is ever coming
    assert read_table(paths["dev_zero"], Layer.USER)[2] is None
    strict = tmp_path / "s.yaml"
    strict.write_text("version: 1\nstrict: true\nrules: 3\n")
    table, problems, header = read_table(strict, Layer.USER)
    assert table is None and problems and header is not None and header.strict is True


# -- class 4: no cross products, linear alias-free loading, bounded suggestions ----------------

def _rule(match: dict[str, Any], line: int = 1, priority: int = 0) -> Any:
    from quantreg.keys import Match
    from quantreg.table.file import Rule

    fields = {k: (None if v == "*" else tuple(sorted(set(v)))) for k, v in match.items()}
    return Rule(match=Match(**fields), methods=("vllm",), path="t.yaml", line=line, layer=Layer.USER,
                priority=priority, where=f"rules[{line}]")


def test_a_220_value_rule_is_indexed_without_its_cross_product() -> None:
    from quantreg.index import Index
    from quantreg.keys import Key

    values = [f"v{i}" for i in range(220)]
    index = Index([_rule({"quant_format": values, "model_type": values, "device": values})])
    assert sum(len(t) for t in index._by_pattern.values()) == 0  # nothing expanded
    assert sum(len(v) for by in index._wide.values() for v in by.values()) == 220  # one posting per value
    assert [r.line for r in index.candidates(Key("v3", "v219", "v100"))] == [1]
    assert index.candidates(Key("v3", "v219", "nope")) == []
    assert index.ambiguous_pairs() == []


match_field = st.one_of(st.just("*"), st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=8))
rule_rows = st.lists(st.tuples(st.fixed_dictionaries({"quant_format": match_field, "model_type": match_field,
                                                      "device": match_field}), st.integers(0, 1)), max_size=8)


@settings(max_examples=300, deadline=None, database=None)
@given(rule_rows)
def test_index_and_ambiguities_equal_brute_force_with_wide_and_narrow_rules(rows: list[Any]) -> None:
    from itertools import combinations

    from quantreg.index import MAX_AMBIGUITIES, Index
    from quantreg.keys import Key

    rules = [_rule(m, line=i + 1, priority=p) for i, (m, p) in enumerate(rows)]
    index = Index(rules)
    for key in [Key(q, m, d) for q in "abz" for m in "chz" for d in "ahz"]:
        expected = sorted((r for r in rules if r.match.matches(key)), key=lambda r: (tuple(-x for x in r.rank), r.line))
        assert index.candidates(key) == expected
    brute = {(a.line, b.line) for a, b in combinations(rules, 2) if a.rank == b.rank and a.match.overlaps(b.match)}
    found = {(a.line, b.line) for a, b in index.ambiguous_pairs()}
    assert found == brute if len(brute) < MAX_AMBIGUITIES else len(found) == MAX_AMBIGUITIES


def test_a_large_legitimate_table_is_not_an_alias_bomb(tmp_path: Path) -> None:
    many_rules_text = _bench_module().many_rules_text

    path = tmp_path / "large.yaml"
    path.write_text(many_rules_text(12_000))
    table, problems, _ = read_table(path, Layer.USER)
    assert problems == [] and table is not None and len(table.rules) == 12_000


def test_aliases_beyond_the_first_occurrence_still_count_as_a_bomb() -> None:
    from quantreg.table.located import MAX_NODES

    rows = ", ".join(["*a"] * (MAX_NODES // 100 + 1))
    text = "version: 1\nrules: []\nx: &a [" + ", ".join(["1"] * 99) + "]\ny: [" + rows + "]\n"
    _, problems, _ = parse_table(text, "bomb.yaml", Layer.USER)
    assert len(problems) == 1 and "alias bomb" in problems[0].message and problems[0].line == 4


def test_suggestions_are_bounded_in_time_and_size() -> None:
    import time

    from quantreg.problems import did_you_mean, name_list

    methods = sorted(f"method_{i:05d}" for i in range(10_000))
    start = time.process_time()
    hints = [did_you_mean(f"methd_{i:05d}", methods) for i in range(300)]
    assert time.process_time() - start < 10  # was > 20 s (difflib over every name, per name)
    assert hints[42] == "; did you mean 'method_00042'?"
    assert did_you_mean("xmethod_00077", methods) == "; did you mean 'method_00077'?"  # a typo at the start
    listed = name_list(methods)
    assert len(listed) <= 500 and listed.endswith(f"... and {10_000 - listed.count(',')} more")
    assert name_list(["a", "b"]) == "a, b"


def test_unknown_method_messages_are_short_among_ten_thousand_methods(tmp_path: Path) -> None:
    unknown_methods_text = _bench_module().unknown_methods_text

    path = tmp_path / "unknown.yaml"
    path.write_text(unknown_methods_text(10_000, 300))
    registry = Registry.build(config=[path], entry_points=False)
    unknown = [str(p) for p in registry.problems if "unknown method" in p.message]
    assert len(unknown) == 300
    assert max(len(p) - len(str(path)) for p in unknown) <= 500
    assert all("... and " in p for p in unknown)


# -- class 11: parse-cache entries carry a checksum of their own content; validate bypasses ----

def _default_entry(cache: Path) -> Path:
    from quantreg.builtin import default_table_path
    from quantreg.table import cache as tablecache

    os.environ[tablecache.ENV] = str(cache)
    try:
        entry = tablecache.entry_path(Path(default_table_path()).read_text(encoding="utf-8"))
    finally:
        del os.environ[tablecache.ENV]
    assert entry is not None
    return entry


def _rename_vllm(data: Any) -> Any:
    """The default table's JSON with every method name 'vllm' changed: different, valid located JSON."""
    return json.loads(json.dumps(data).replace('"vllm"', '"vllm_renamed"'))


def _cli_env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    return {**env, "QUANTREG_PLUGINS": "", "QUANTREG_CACHE_DIR": str(cache)}


def test_an_entry_corrupted_into_other_valid_json_is_not_trusted(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from quantreg.table import cache as tablecache

    monkeypatch.setenv(tablecache.ENV, str(tmp_path / "cache"))
    path = tmp_path / "plugin.yaml"
    path.write_text("version: 1\nrules:\n  - match: {device: cpu}\n    method: vllm\n")
    fresh, _, _ = read_table(path, Layer.PLUGIN)
    entry = next((tmp_path / "cache" / "tables").glob("*.json"))
    good = entry.read_bytes()
    header, _, payload = good.partition(b"\n")
    entry.write_bytes(header + b"\n" + payload.replace(b'"vllm"', b'"vllx"'))  # valid JSON, stale checksum
    again, problems, _ = read_table(path, Layer.PLUGIN)
    assert problems == [] and again == fresh and again is not None and again.rules[0].methods == ("vllm",)
    assert entry.read_bytes() == good  # rewritten from the real parse
    entry.write_bytes(b"0" * 64 + b"\n" + payload)  # a wrong header
    assert read_table(path, Layer.PLUGIN)[0] == fresh
    other = entry.with_name("0" * 64 + ".json")  # a valid entry moved onto another text's name
    other.write_bytes(good)
    assert tablecache.read_entry(other) is None and tablecache.read_entry(entry) is not None


def test_bypass_never_reads_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from quantreg.table import cache as tablecache

    monkeypatch.setenv(tablecache.ENV, str(tmp_path / "cache"))
    path = tmp_path / "plugin.yaml"
    path.write_text("version: 1\nrules:\n  - match: {device: cpu}\n    method: vllm\n")
    read_table(path, Layer.PLUGIN)
    entry = next((tmp_path / "cache" / "tables").glob("*.json"))
    forged = tablecache.read_entry(entry)
    entry.write_bytes(tablecache.encode_entry(entry.name, json.loads(json.dumps(forged).replace('"cpu"', '"hpu"'))))
    cached, _, _ = read_table(path, Layer.PLUGIN)
    assert cached is not None and cached.rules[0].match.device == ("hpu",)  # a checksummed entry is believed...
    with tablecache.bypass():
        assert tablecache.bypassed()
        with tablecache.bypass():  # nests
            pass
        assert tablecache.bypassed()
        parsed, _, _ = read_table(path, Layer.PLUGIN)
    assert not tablecache.bypassed()
    assert parsed is not None and parsed.rules[0].match.device == ("cpu",)  # ... except inside bypass()


def test_validate_ignores_a_corrupted_default_table_entry(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert run_cli("validate", env=_cli_env(cache)).returncode == 0  # fills the cache
    entry = _default_entry(cache)
    header, _, payload = entry.read_bytes().partition(b"\n")
    entry.write_bytes(header + b"\n" + json.dumps(_rename_vllm(json.loads(payload))).encode())
    out = run_cli("validate", "--json", env=_cli_env(cache))
    assert out.returncode == 0, out.stdout
    assert json.loads(out.stdout)["problems"] == []


def test_validate_parses_the_files_even_with_a_forged_entry(tmp_path: Path) -> None:
    from quantreg.table import cache as tablecache

    cache = tmp_path / "cache"
    assert run_cli("validate", env=_cli_env(cache)).returncode == 0
    entry = _default_entry(cache)
    data = tablecache.read_entry(entry)
    entry.write_bytes(tablecache.encode_entry(entry.name, _rename_vllm(data)))  # checksum recomputed
    out = run_cli("validate", "--json", env=_cli_env(cache))
    assert out.returncode == 0 and json.loads(out.stdout)["problems"] == [], out.stdout


# -- class 10 (loader part): alias lines, one line per problem, any path on any stdout, names --

def test_a_rule_repeated_through_an_alias_is_reported_at_the_alias() -> None:
    text = "version: 1\nrules:\n  - &r {match: {device: cpu}, method: vllm}\n  - note\n  - *r\n"
    table, problems, _ = parse_table(text, "t.yaml", Layer.USER)
    assert [(p.line, p.key) for p in problems] == [(4, "rules[1]")]
    text = "version: 1\nrules:\n  - &r\n    match: {device: cpu}\n    method: vllm\n\n  - *r\n"
    table, problems, _ = parse_table(text, "t.yaml", Layer.USER)
    assert problems == [] and table is not None
    assert [r.line for r in table.rules] == [3, 7]


def test_a_path_with_a_newline_gives_one_escaped_line(tmp_path: Path) -> None:
    bad = tmp_path / "two\nlines.yaml"
    bad.write_text("version: 2\nrules: []\n")
    out = run_cli("validate", str(bad))
    assert out.returncode == 1
    assert out.stdout.splitlines() == [f"{tmp_path}/two\\nlines.yaml:1: version: unsupported schema version 2; "
                                       "this quantreg reads version 1"]
    reg = run_register([str(bad)])
    data = json.loads(reg.stdout.splitlines()[-1])
    assert data["problems"] == [f"{tmp_path}/two\\nlines.yaml:1: version: unsupported schema version 2; "
                                "this quantreg reads version 1"]


def test_a_non_utf8_path_on_a_strict_utf8_stdout(tmp_path: Path) -> None:
    raw = os.fsencode(str(tmp_path)) + b"/caf\xe9.yaml"
    with open(raw, "wb") as f:
        f.write(b"version: 1\nrules: {}\n")
    path = os.fsdecode(raw)  # 'caf\udce9.yaml' (surrogateescape)
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    env.update(QUANTREG_PLUGINS="", PYTHONIOENCODING="utf-8:strict", LC_ALL="C.UTF-8")
    for args in (["validate"], ["validate", "--json"]):
        out = subprocess.run([sys.executable, "-m", "quantreg", *args, raw], capture_output=True, env=env, timeout=120)
        text = out.stdout.decode("utf-8")  # valid UTF-8 throughout
        assert out.returncode == 1, out.stderr
        assert b"Traceback" not in out.stderr and "UnicodeEncodeError" not in text
        lines = [p["text"] for p in json.loads(text)["problems"]] if "--json" in args else text.splitlines()
        assert any(p.endswith("caf\\udce9.yaml:2: rules: expected a list of rules, got mapping") for p in lines)
    _, problems, _ = read_table(path, Layer.USER)
    assert str(problems[0]).encode("utf-8")  # printable on a strict stream


@pytest.mark.parametrize("value", ["modèle_moe", "模型", "Ελληνικά-2", "gpt_oss"])
def test_non_ascii_model_types_are_accepted_verbatim(value: str, tmp_path: Path) -> None:
    from quantreg.keys import Key
    from quantreg.table.schema import table_schema

    path = tmp_path / "u.yaml"
    path.write_text(f"version: 1\nrules:\n  - match: {{model_type: {value}}}\n    method: vllm\n    priority: 3\n",
                    encoding="utf-8")
    table, problems, _ = read_table(path, Layer.USER)
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
    _, problems, _ = parse_table(text, "t.yaml", Layer.USER)
    assert problems and "\n" not in str(problems[0]) and "\u2028" not in str(problems[0])


def test_method_names_stay_ascii() -> None:
    _, problems, _ = parse_table("version: 1\nrules:\n  - match: {}\n    method: méthode\n", "t.yaml", Layer.USER)
    assert [p.key for p in problems] == ["rules[0].method"]


def _bench_module() -> Any:
    """bench/registry_bench.py by path: the tests and the bench build the same pathological tables,
    and ``bench`` is not importable from every working directory the suite runs in."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:  # registry_bench imports bench.common
        sys.path.insert(0, str(root))
    path = root / "bench" / "registry_bench.py"
    spec = importlib.util.spec_from_file_location("quantreg_bench_registry", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
