"""A match key declared in ``keys.MATCH_KEYS`` (docs/design.md, "Recipe: a match key") works end to end.

The shipped table declares none yet, so each test declares one for its run (``dtype``, a closed set with a
default) and drives real YAML tables through the parser, the index, the registry, the rule JSON, the JSON
Schema and ``explain``'s parser: the one declaration is all those stages read.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import yaml

from quantreg import Key, Registry, keys
from quantreg.cli import build_parser, subcommands
from quantreg.keys import MatchKey
from quantreg.table.file import Tier, parse_table, rule_json
from quantreg.table.schema import table_schema

pytestmark = pytest.mark.usefixtures("clean_env")

DTYPE = MatchKey("dtype", "the activation dtype the rule decides", values=("bf16", "fp16"), default="bf16")
TABLE = """\
version: 1
allow_import_targets: true
methods:
  m_any: {target: 'json:JSONDecoder'}
  m_half: {target: 'json:JSONEncoder'}
rules:
  - match: {quant_format: fp8}
    method: m_any
  - match: {quant_format: fp8, dtype: fp16}
    method: m_half
"""


@pytest.fixture
def dtype_declared(monkeypatch: pytest.MonkeyPatch) -> Iterator[MatchKey]:
    monkeypatch.setattr(keys, "MATCH_KEYS", (DTYPE,))
    yield DTYPE


def registry(tmp_path: Path, text: str) -> Registry:
    path = tmp_path / "t.yaml"
    path.write_text(text)
    return Registry.build(config=[path], entry_points=False)


def test_a_declared_key_decides_and_counts_in_specificity(tmp_path: Path, dtype_declared: MatchKey) -> None:
    reg = registry(tmp_path, TABLE)
    assert not reg.problems, reg.problems
    assert reg.resolve(Key("fp8", "llama", "cpu")).method == "m_any"  # the default value: the rule without it
    half = reg.resolve(Key("fp8", "llama", "cpu", dtype="fp16"))
    assert half.method == "m_half" and half.rule is not None and half.rule.match.specificity == 2
    assert str(half.rule.match) == "(fp8, *, *, dtype=fp16)" and str(half.key) == "(fp8, llama, cpu, dtype=fp16)"
    assert half.key.as_json() == {"quant_format": "fp8", "model_type": "llama", "device": "cpu", "dtype": "fp16"}
    assert rule_json(half.rule)["match"]["dtype"] == ["fp16"]
    assert "dtype" not in rule_json(reg.resolve(Key("fp8", "llama", "cpu")).rule)["match"]  # type: ignore[arg-type]


def test_a_key_at_its_default_is_the_key_before_the_declaration(dtype_declared: MatchKey) -> None:
    plain, explicit = Key("fp8", "llama", "cpu"), Key("fp8", "llama", "cpu", dtype="bf16")
    assert plain == explicit and hash(plain) == hash(explicit) == hash(("fp8", "llama", "cpu"))
    assert Key("fp8", "llama", "cpu", dtype="fp16") != plain and repr(explicit) == "Key('fp8', 'llama', 'cpu')"
    assert Key("fp8", "llama", "cpu", dtype="fp16").of_layer("dense").value("dtype") == "fp16"
    with pytest.raises(TypeError, match="unknown match key 'dtipe'"):
        Key("fp8", "llama", "cpu", dtipe="fp16")


def test_disjoint_values_are_not_ambiguous_and_overlapping_ones_are(tmp_path: Path,
                                                                      dtype_declared: MatchKey) -> None:
    two = ("version: 1\nrules:\n  - match: {quant_format: fp8, dtype: fp16}\n    method: vllm\n"
           "  - match: {quant_format: fp8, dtype: %s}\n    method: vllm\n")
    assert not registry(tmp_path, two % "bf16").problems
    problems = [str(p) for p in registry(tmp_path, two % "[bf16, fp16]").problems]
    assert len(problems) == 1 and "ambiguous" in problems[0], problems


@pytest.mark.parametrize(("value", "message"), [
    ("fp61", "t.yaml:3: rules[0].match.dtype: expected one of bf16, fp16, got 'fp61'; did you mean 'fp16'?"),
    ("'*'", "rules[0].match.dtype: '*' is not a value; leave 'dtype' out to match every value"),
    ("[]", "rules[0].match.dtype: empty list; expected one of bf16, fp16 or a list of them"),
    ("3", "rules[0].match.dtype: expected one of bf16, fp16 or a list of them, got integer"),
])
def test_bad_values_are_located_problems(dtype_declared: MatchKey, value: str, message: str) -> None:
    text = f"version: 1\nrules:\n  - match: {{dtype: {value}}}\n    method: vllm\n"
    _, problems, _ = parse_table(text, "t.yaml", Tier.USER)
    assert [str(p) for p in problems] == [message if message.startswith("t.yaml") else f"t.yaml:3: {message}"]


def test_undeclared_it_is_an_unknown_key_as_before() -> None:
    _, problems, _ = parse_table("version: 1\nrules:\n  - match: {dtype: fp16}\n    method: vllm\n", "t.yaml",
                                 Tier.USER)
    assert len(problems) == 1 and "unknown key" in str(problems[0])


def test_absent_can_mean_only_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keys, "MATCH_KEYS", (MatchKey("dtype", "d", values=("bf16", "fp16"), default="bf16",
                                                      absent_matches_any=False),))
    reg = registry(tmp_path, "version: 1\nrules:\n  - match: {quant_format: fp8}\n    method: vllm\n")
    assert reg.resolve(Key("fp8", "m", "cpu")).rule is not None
    assert reg.resolve(Key("fp8", "m", "cpu", dtype="fp16")).rule is None  # not even the default table's (*, *, *)


def test_the_schema_and_explain_read_the_declaration(dtype_declared: MatchKey) -> None:
    validator = jsonschema.Draft202012Validator(table_schema())
    assert not list(validator.iter_errors(yaml.safe_load(TABLE)))
    assert list(validator.iter_errors(yaml.safe_load(TABLE.replace("dtype: fp16", "dtype: fp61"))))
    explain = subcommands(build_parser())["explain"]
    args = explain.parse_args(["fp8", "llama", "cpu", "--dtype", "fp16"])
    assert args.key_dtype == "fp16" and explain.parse_args(["fp8", "llama", "cpu"]).key_dtype == "bf16"
