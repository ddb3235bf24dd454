"""Tables written with the names issue 47 retired read, validate and decide exactly as with the new ones.

The old spelling a table can hold is ``verify: {layers: N}`` (now ``decoders``); the precedence word
"layer" (now "tier") never appeared in a table, only in output and in the API (``quantreg.Layer`` stays
an alias). Each pair below is two real YAML files differing only in the spelling: the same rules,
the same decisions, the same fingerprint, and for the old one a single located deprecation line
(logged once, and printed by ``validate`` and ``explain`` through the real console script).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
from core_support import run_cli

import quantreg
from quantreg import Key, Registry
from quantreg.table.file import Tier, read_table, rule_json
from quantreg.table.schema import table_schema

pytestmark = pytest.mark.usefixtures("clean_env")

METHODS = "methods:\n  e2e_x: {target: 'json:JSONDecoder'}\nallow_import_targets: true\n"
#: (old spelling, new spelling) of one rule's verify: count and list forms, and with other keys around it
PAIRS = [
    ("{against: float64, layers: 2}", "{against: float64, decoders: 2}"),
    ("{against: float64, every: 500, first: 4, tolerance: 0.01, layers: [0, 2]}",
     "{against: float64, every: 500, first: 4, tolerance: 0.01, decoders: [0, 2]}"),
    ("\n      against: float64\n      layers: [5, 1]\n", "\n      against: float64\n      decoders: [5, 1]\n"),
]


def text(verify: str, method: str = "e2e_x") -> str:
    return ("version: 1\nrules:\n  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss}\n"
            f"    method: {method}\n    verify: {verify}\n" + METHODS)


def without_path(data: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in data.items() if k != "path"}


@pytest.mark.parametrize(("old", "new"), PAIRS)
def test_old_and_new_spelling_read_decide_and_fingerprint_alike(
        table: Callable[[str, str], Path], old: str, new: str) -> None:
    old_path, new_path = table("old.yaml", text(old)), table("new.yaml", text(new))
    old_table, old_problems, old_header = read_table(old_path, Tier.USER)
    new_table, new_problems, new_header = read_table(new_path, Tier.USER)
    assert old_problems == new_problems == [] and old_table is not None and new_table is not None
    assert old_table.rules[0].verify == new_table.rules[0].verify is not None
    assert [without_path(rule_json(r)) for r in old_table.rules] == \
        [without_path(rule_json(r)) for r in new_table.rules]
    assert old_header is not None and new_header is not None and new_header.deprecations == ()
    [deprecation] = old_header.deprecations
    assert (deprecation.path, deprecation.key) == (str(old_path), "rules[0].verify.layers")
    assert deprecation.line == text(old).splitlines().index(next(
        line for line in text(old).splitlines() if "layers" in line)) + 1
    assert "'decoders'" in deprecation.message

    registries = [Registry.build(config=[p], env={"QUANTREG_PLUGINS": ""}) for p in (old_path, new_path)]
    assert registries[0].fingerprint() == registries[1].fingerprint()
    decisions = [r.resolve(Key("gpt_oss_mxfp4", "gpt_oss", "cpu")) for r in registries]
    assert [d.method for d in decisions] == ["e2e_x", "e2e_x"]
    assert decisions[0].rule is not None and decisions[1].rule is not None
    assert decisions[0].rule.verify == decisions[1].rule.verify
    assert decisions[0].render().replace(str(old_path), "T") == decisions[1].render().replace(str(new_path), "T")
    validator = jsonschema.Draft202012Validator(table_schema())  # editors' schema accepts both spellings
    import yaml

    assert not list(validator.iter_errors(yaml.safe_load(text(old))))
    assert not list(validator.iter_errors(yaml.safe_load(text(new))))


def test_the_deprecation_is_one_located_warning_per_process(
        table: Callable[[str, str], Path], caplog: pytest.LogCaptureFixture) -> None:
    path = table("once.yaml", text("{against: float64, layers: 3}"))
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg.table"):
        for _ in range(3):  # every Registry.build reads the file again
            read_table(path, Tier.USER)
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.quantreg.table"]
    assert lines == [f"quantreg: {path}:5: rules[0].verify.layers: deprecated spelling of 'decoders' (read the "
                     "same); write 'decoders:'"]


def test_both_spellings_in_one_rule_is_a_located_problem(table: Callable[[str, str], Path]) -> None:
    path = table("both.yaml", text("{against: float64, layers: 2, decoders: 2}"))
    found, problems, _ = read_table(path, Tier.USER)
    assert found is None and [str(p) for p in problems] == [
        f"{path}:5: rules[0].verify.layers: the old spelling of 'decoders', which this rule also writes; "
        "keep only 'decoders'"]


def test_a_bad_value_under_the_old_spelling_names_the_key_as_written(table: Callable[[str, str], Path]) -> None:
    path = table("bad.yaml", text("{against: float64, layers: 0}"))
    _, problems, _ = read_table(path, Tier.USER)
    assert [p.key for p in problems] == ["rules[0].verify.layers"]


def test_validate_and_explain_print_the_deprecation_through_the_real_cli(table: Callable[[str, str], Path]) -> None:
    old, new = table("old.yaml", text("{against: float64, layers: 2}")), table("new.yaml", text("{against: float64, "
                                                                                              "decoders: 2}"))
    line = f"{old}:5: rules[0].verify.layers: deprecated spelling of 'decoders' (read the same); write 'decoders:'"
    out = run_cli("validate", str(old))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout.splitlines() == ["ok: 1 table(s) valid", f"deprecated {line}"]
    out = run_cli("validate", str(new))
    assert out.returncode == 0 and out.stdout.splitlines() == ["ok: 1 table(s) valid"], out.stdout + out.stderr
    answers = []
    for path in (old, new):
        got = run_cli("explain", "gpt_oss_mxfp4", "gpt_oss", "cpu", "--config", str(path), "--json")
        assert got.returncode == 0, got.stderr
        answers.append(json.loads(got.stdout.replace(json.dumps(str(path))[1:-1], "TABLE")))
    assert answers[0]["deprecations"] == [line.replace(str(old), "TABLE")] and answers[1]["deprecations"] == []
    for a in answers:
        a.pop("deprecations")
    assert answers[0] == answers[1] and answers[0]["method"] == "e2e_x"
    text_out = run_cli("explain", "gpt_oss_mxfp4", "gpt_oss", "cpu", "--config", str(old)).stdout
    assert f"deprecated {line}" in text_out.splitlines()


def test_the_api_keeps_the_old_name_of_the_tier_class() -> None:
    assert quantreg.Layer is quantreg.Tier is Tier and str(Tier.USER) == "user"
