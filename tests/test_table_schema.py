"""The published JSON Schema agrees with the real loader.

Checked three ways: it accepts every good table, it rejects every corpus table whose fault a
schema can express (``schema: true`` in ``bad_tables/expected.yaml``), and on random documents
(hypothesis) it accepts exactly what :func:`quantreg.table.file.parse_table` accepts. Method names
and ambiguity depend on the installed plugins and are left to the loader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from core_support import BAD_TABLES, GOOD_TABLES, ROOT, run_cli
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from quantreg.keys import FIELDS
from quantreg.table.file import Tier, parse_table
from quantreg.table.schema import table_schema

pytestmark = pytest.mark.usefixtures("clean_env")

SCHEMA = table_schema()
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
EXPECTED: dict[str, dict[str, Any]] = yaml.safe_load((BAD_TABLES / "expected.yaml").read_text(encoding="utf-8"))
SCHEMA_BAD = sorted(name for name, entry in EXPECTED.items() if entry["schema"])
GOOD = [*sorted(GOOD_TABLES.glob("*.yaml")), ROOT / "registry.yaml"]


def test_schema_is_a_valid_draft_2020_12_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["required"] == ["version", "rules"]
    assert set(SCHEMA["properties"]["rules"]["items"]["properties"]) == {"match", "method", "options", "priority",
                                                                         "note", "verify", "tuned"}


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_cli_prints_the_schema(json_flag: list[str]) -> None:
    out = run_cli("schema", *json_flag)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)  # plain: the bare schema (for editors); --json: the envelope, schema under "schema"
    assert (data["schema"] if json_flag else data) == SCHEMA


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.name)
def test_schema_accepts_good_tables(path: Path) -> None:
    VALIDATOR.validate(yaml.safe_load(path.read_text(encoding="utf-8")))


def test_most_of_the_corpus_is_schema_expressible() -> None:
    assert len(SCHEMA_BAD) >= 25


@pytest.mark.parametrize("name", SCHEMA_BAD)
def test_schema_rejects_expressible_bad_tables(name: str) -> None:
    doc = yaml.safe_load((BAD_TABLES / name).read_text(encoding="utf-8"))
    assert not VALIDATOR.is_valid(doc), f"the schema accepts {name}"
    # ... and the loader rejects the same document
    _, problems, _ = parse_table(yaml.safe_dump(doc), name, Tier.USER)
    assert problems


# -- differential: random documents ----------------------------------------------------------
names = st.sampled_from(["cpu", "hpu", "fp8", "gpt_oss", "Mixed.Prec-1", "vllm", "*", "", "a b", "x\n", "1"])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2, 3), st.sampled_from([1.5, -0.25]), names)
match_values = st.one_of(scalars, st.lists(st.one_of(names, st.integers(0, 2)), max_size=3))
matches = st.one_of(
    scalars,
    st.lists(names, max_size=2),
    st.dictionaries(st.sampled_from([*FIELDS, "devcie"]), match_values, max_size=3),
)
methods = st.one_of(scalars, st.lists(st.one_of(names, st.integers(0, 1)), max_size=3),
                    st.dictionaries(names, names, max_size=1))
options = st.one_of(scalars, st.lists(names, max_size=2),
                    st.dictionaries(st.sampled_from(["chunk", "k"]), st.one_of(scalars, st.lists(names)), max_size=2))
rules = st.one_of(
    scalars,
    st.fixed_dictionaries({}, optional={"match": matches, "method": methods, "options": options,
                                        "priority": scalars, "note": scalars, "methd": names}),
)
good_names = st.sampled_from(["cpu", "hpu", "fp8", "vllm", "Mixed.Prec-1"])
good_rules = st.fixed_dictionaries(
    {"match": st.dictionaries(st.sampled_from(FIELDS), st.one_of(good_names, st.lists(good_names, min_size=1)),
                              max_size=3),
     "method": st.one_of(good_names, st.lists(good_names, min_size=1, max_size=3, unique=True))},
    optional={"options": st.one_of(st.none(), st.dictionaries(st.sampled_from(["chunk"]), scalars), options),
              "priority": st.one_of(st.integers(-2, 2), scalars), "note": st.one_of(names, scalars)},
)
documents = st.one_of(
    scalars,
    st.lists(names, max_size=2),
    st.fixed_dictionaries({}, optional={"version": st.one_of(st.just(1), scalars), "strict": scalars,
                                        "rules": st.one_of(st.lists(rules, max_size=3), scalars),
                                        "rulez": names}),
    # nearly valid tables, so that a single odd value decides
    st.fixed_dictionaries({"version": st.just(1), "rules": st.lists(good_rules, max_size=3)},
                          optional={"strict": scalars}),
)


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents)
@example({"version": 1, "rules": [], "strict": None})
@example({"version": 1, "rules": [{"match": {"device": "hpu\n"}, "method": "vllm"}]})
@example({"version": 1, "rules": [{"match": {}, "method": "vllm\n"}]})
@example({"version": 1, "rules": [{"match": None, "method": "vllm", "options": None}]})
def test_schema_and_loader_agree_on_random_documents(doc: Any) -> None:
    text = yaml.safe_dump(doc)
    _, problems, _ = parse_table(text, "random.yaml", Tier.USER)
    loaded = yaml.safe_load(text)
    assert VALIDATOR.is_valid(loaded) == (not problems), (text, problems)


def test_known_difference_integral_floats() -> None:
    """JSON Schema counts 2.0 as an integer; the loader insists on an integer literal (stricter)."""
    doc = {"version": 1, "rules": [{"match": {}, "method": "vllm", "priority": 2.0}]}
    assert VALIDATOR.is_valid(doc)
    _, problems, _ = parse_table(yaml.safe_dump(doc), "t.yaml", Tier.USER)
    assert [p.key for p in problems] == ["rules[0].priority"]
