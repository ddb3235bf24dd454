"""The YAML loader: located values, every schema check of version-1 tables, and good tables."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from core_support import GOOD_TABLES, ROOT

from quantreg.keys import Match
from quantreg.problems import Problem, QuantregError, did_you_mean
from quantreg.table.file import Tier, parse_table, read_table
from quantreg.table.yamlfile import MAX_NODES, LocatedDict, LocatedList, YamlError, parse

pytestmark = pytest.mark.usefixtures("clean_env")

GOOD = sorted(GOOD_TABLES.glob("*.yaml"))


# -- yamlfile ------------------------------------------------------------------------------
def test_parse_remembers_lines_of_keys_and_items() -> None:
    doc = parse("version: 1\nrules:\n  - match: {}\n    method: vllm\n  - {match: {}, method: x}\n")
    assert isinstance(doc, LocatedDict) and doc.line == 1
    assert doc.key_lines == {"version": 1, "rules": 2}
    rules = doc["rules"]
    assert isinstance(rules, LocatedList) and rules.item_lines == [3, 5]
    assert rules[0].key_lines == {"match": 3, "method": 4}
    assert doc == {"version": 1, "rules": [{"match": {}, "method": "vllm"}, {"match": {}, "method": "x"}]}


def test_parse_empty_document_is_none() -> None:
    assert parse("") is None
    assert parse("# nothing\n\n# here\n") is None


@pytest.mark.parametrize(
    ("text", "line", "key", "fragment"),
    [
        ("a: 1\nb:\n  c: 1\n  c: 2\n", 4, "b.c", "duplicate key (first at line 3)"),
        ("a: !!python/object:os.system {}\n", 1, "a", "tag 'tag:yaml.org,2002:python/object:os.system' is not allowed"),
        ("a: !custom 1\n", 1, "a", "tag '!custom' is not allowed"),
        ("base: &b {x: 1}\nother:\n  <<: *b\n", 3, "other", "merge keys"),
        ("a: [1\n", 2, "", "YAML syntax error"),
        ("a: 1\n---\nb: 2\n", 2, "", "expected a single document"),
        ("? [a, b]\n: 1\n", 1, "", "mapping keys must be plain scalars"),
    ],
)
def test_parse_refuses(text: str, line: int, key: str, fragment: str) -> None:
    with pytest.raises(YamlError) as info:
        parse(text)
    assert (info.value.line, info.value.key) == (line, key)
    assert fragment in info.value.message


def test_parse_bounds_alias_expansion() -> None:
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 7)]
    with pytest.raises(YamlError) as info:
        parse("\n".join(levels) + "\n")
    assert f"more than {MAX_NODES} nodes" in info.value.message
    assert info.value.line is not None


def test_parse_control_character_has_a_line() -> None:
    with pytest.raises(YamlError) as info:
        parse("version: 1\nrules: []\nx: \"a\x00b\"\n")
    assert info.value.line == 3
    assert "#x0000" in info.value.message


# -- problems ------------------------------------------------------------------------------
def test_problem_text_and_error_carry_every_problem() -> None:
    a = Problem("t.yaml", 4, "rules[0].method", "unknown method 'x'")
    b = Problem("u.yaml", None, "", "no such file")
    assert str(a) == "t.yaml:4: rules[0].method: unknown method 'x'"
    assert str(b) == "u.yaml: no such file"
    err = QuantregError([a, b])
    assert err.problems == (a, b)
    assert str(err) == f"{a}\n{b}"
    assert QuantregError("plain").problems == ()


def test_did_you_mean() -> None:
    assert did_you_mean("methd", ["match", "method"]) == "; did you mean 'method'?"
    assert did_you_mean("zzz", ["match", "method"]) == ""


# -- tables --------------------------------------------------------------------------------
def test_rule_fields_and_locations(table: Callable[[str, str], Path]) -> None:
    path = table("t.yaml", """
        version: 1
        strict: true
        rules:
          - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: [hpu, cpu, hpu]}
            method:
              - hpu_mxfp4
              - hpu_mxfp4_dequant
            options: {chunk: 4, deep: {k: [1, 2]}}
            priority: 2
            note: why
          - match: {model_type: "*"}
            method: vllm
    """)
    tf, problems, _ = read_table(path, Tier.RUN)
    assert problems == [] and tf is not None
    assert tf.strict is True and tf.tier is Tier.RUN and tf.path == str(path)
    first, second = tf.rules
    assert first.match == Match(quant_format=("gpt_oss_mxfp4",), model_type=("gpt_oss",), device=("cpu", "hpu"))
    assert first.methods == ("hpu_mxfp4", "hpu_mxfp4_dequant")
    assert first.method_lines == (6, 7)
    assert (first.line, first.priority, first.note, first.tier) == (4, 2, "why", Tier.RUN)
    assert first.location == f"{path}:4"
    assert first.options == {"chunk": 4, "deep": {"k": [1, 2]}}
    assert type(first.options["deep"]) is dict and type(first.options["deep"]["k"]) is list
    with pytest.raises(TypeError):
        first.options["chunk"] = 5  # type: ignore[index]
    assert first.rank == (int(Tier.RUN), 3, 2)
    assert second.match == Match() and second.methods == ("vllm",) and second.line == 11
    assert second.options == {} and second.priority == 0 and second.note == ""


def test_null_match_and_null_options_are_empty() -> None:
    tf, problems, _ = parse_table("version: 1\nrules:\n  - match:\n    method: vllm\n    options:\n", "t", Tier.USER)
    assert problems == [] and tf is not None
    assert tf.rules[0].match == Match() and tf.rules[0].options == {}


def test_a_file_with_any_problem_contributes_no_rules() -> None:
    text = "version: 1\nrules:\n  - {match: {}, method: vllm}\n  - {match: {}, method: vllm, priority: x}\n"
    tf, problems, _ = parse_table(text, "t.yaml", Tier.USER)
    assert tf is None
    assert [(p.line, p.key) for p in problems] == [(4, "rules[1].priority")]


def test_every_problem_of_a_file_is_reported_at_once() -> None:
    text = "version: 2\nrulez: []\nrules:\n  - {match: {devcie: hpu}, method: []}\n  - 5\n"
    _, problems, _ = parse_table(text, "t.yaml", Tier.USER)
    assert [(p.line, p.key) for p in problems] == [
        (2, "rulez"), (1, "version"), (4, "rules[0].match.devcie"), (4, "rules[0].method"), (5, "rules[1]")]


@pytest.mark.parametrize(
    ("snippet", "key", "fragment"),
    [
        ("{match: {device: hpu}, method: vllm, prio: 1}", "rules[0].prio", "did you mean 'priority'?"),
        ("{match: {device: 'a b'}, method: vllm}", "rules[0].match.device", "'a b' is not a valid name"),
        ("{match: {device: [hpu, 3]}, method: vllm}", "rules[0].match.device", "list items must be strings"),
        ("{match: {device: null}, method: vllm}", "rules[0].match.device", "got null"),
        ("{match: {}, method: [vllm, 4]}", "rules[0].method[1]", "expected a method name, got integer"),
        ("{match: {}, method: 'my method'}", "rules[0].method", "not a valid name"),
        ("{match: {}, method: vllm, options: {1: a}}", "rules[0].options", "option names must be strings"),
        ("{match: {}, method: vllm, note: null}", "rules[0].note", "expected a string, got null"),
    ],
)
def test_rule_checks(snippet: str, key: str, fragment: str) -> None:
    _, problems, _ = parse_table(f"version: 1\nrules:\n  - {snippet}\n", "t.yaml", Tier.USER)
    assert any(p.key == key and fragment in p.message and p.line == 3 for p in problems), problems


def test_names_must_match_entirely() -> None:
    """A trailing newline is not part of a valid name (the JSON Schema pattern agrees)."""
    _, problems, _ = parse_table('version: 1\nrules:\n  - {match: {device: "hpu\\n"}, method: vllm}\n', "t",
                              Tier.USER)
    assert [p.key for p in problems] == ["rules[0].match.device"]
    _, problems, _ = parse_table('version: 1\nrules:\n  - {match: {}, method: "vllm\\n"}\n', "t", Tier.USER)
    assert [p.key for p in problems] == ["rules[0].method"]


def test_strict_must_be_a_boolean() -> None:
    _, problems, _ = parse_table("version: 1\nstrict: yes please\nrules: []\n", "t.yaml", Tier.USER)
    assert [(p.line, p.key) for p in problems] == [(2, "strict")]


def test_read_table_missing_file_and_directory(tmp_path: Path) -> None:
    _, problems, _ = read_table(tmp_path / "nope.yaml", Tier.USER)
    assert [str(p) for p in problems] == [f"{tmp_path / 'nope.yaml'}: no such file"]
    _, problems, _ = read_table(tmp_path, Tier.USER)
    assert "is a directory" in str(problems[0])


def test_read_table_non_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("version: 1\nrules:\n  - match: {}\n    note: caf\xe9\n".encode("latin-1"))
    _, problems, _ = read_table(path, Tier.USER)
    assert [(p.line, p.key) for p in problems] == [(4, "")]
    assert "not UTF-8 (byte 0xe9" in problems[0].message


def test_utf8_bom_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.yaml"
    path.write_bytes(b"\xef\xbb\xbfversion: 1\nrules: []\n")
    tf, problems, _ = read_table(path, Tier.USER)
    assert problems == [] and tf is not None and tf.rules == ()


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.name)
def test_good_tables_load(path: Path) -> None:
    tf, problems, _ = read_table(path, Tier.USER)
    assert problems == []
    assert tf is not None and tf.path == str(path)


def test_there_are_good_tables() -> None:
    assert len(GOOD) >= 4
    assert (ROOT / "registry.yaml").exists()


def test_default_table_matches_everything_with_vllm() -> None:
    tf, problems, _ = read_table(ROOT / "registry.yaml", Tier.DEFAULT)
    assert problems == [] and tf is not None
    assert [(r.match, r.methods) for r in tf.rules] == [(Match(), ("vllm",))]
