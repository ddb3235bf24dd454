"""quantreg.table.yamlfile (YAML -> located values) and its bounds in quantreg.table.located: nesting up to
MAX_DEPTH, huge integers, tags, aliases (the fast path equals the pure one; alias bombs and a rule
repeated through an alias are located), no Python object tags.

History (issue 24 class 5): moved from tests/test_containment_loader.py (issue 12, loader classes)
(classes 2, 4, 10) and tests/test_hardening.py (strict vs lenient, plugin fault isolation, security)
(security: the python/object tag).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from core_support import QUANTREG, _bench_module
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantreg.table.file import Tier, parse_table, read_table
from quantreg.table.located import MAX_DEPTH

pytestmark = pytest.mark.usefixtures("clean_env")


# -- from test_containment_loader.py (issue 12, loader classes) -------------------------------


@pytest.mark.parametrize("depth", [MAX_DEPTH - 1, MAX_DEPTH])
def test_nesting_up_to_the_bound_is_accepted(depth: int) -> None:
    # root mapping (1) > rules (2) > rule (3) > options (4) > k's value (5) ...; the scalar counts as a level
    inner = "{a: " * (depth - 5) + "1" + "}" * (depth - 5)
    text = f"version: 1\nrules:\n  - match: {{}}\n    method: vllm\n    options: {{k: {inner}}}\n"
    table, problems, _ = parse_table(text, "deep.yaml", Tier.USER)
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
    table, problems, _ = parse_table(text, "deep.yaml", Tier.USER)
    assert table is None
    assert [(p.line, p.message) for p in problems] == [(5, f"nested more than {MAX_DEPTH} levels deep; "
                                                           "a table needs far fewer")]


def test_large_but_printable_integers_are_still_values() -> None:
    """A 300-digit integer parses (no digit-limit text, no crash): a free option keeps it as a value, and a
    bounded field (``priority``, issue 46 class 5) names its bound and the number's size."""
    text = ("version: 1\nrules:\n  - match: {}\n    method: vllm\n    options: {big: " + "9" * 300 + "}\n")
    table, problems, _ = parse_table(text, "big.yaml", Tier.USER)
    assert problems == [] and table is not None
    assert table.rules[0].options["big"] == int("9" * 300)
    text = "version: 1\nrules:\n  - match: {}\n    method: vllm\n    priority: " + "9" * 300 + "\n"
    table, problems, _ = parse_table(text, "big.yaml", Tier.USER)
    assert table is None and [(p.line, p.key) for p in problems] == [(5, "rules[0].priority")]
    assert problems[0].message.endswith("got an integer of about 301 digits")


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
    table, problems, _ = parse_table(text, "fuzz.yaml", Tier.USER)
    assert (table is None) == bool(problems)
    for problem in problems:
        assert str(problem).startswith("fuzz.yaml") and "\n" not in str(problem)
        assert problem.line is None or problem.line >= 1


def test_a_large_legitimate_table_is_not_an_alias_bomb(tmp_path: Path) -> None:
    many_rules_text = _bench_module().many_rules_text

    path = tmp_path / "large.yaml"
    path.write_text(many_rules_text(12_000))
    table, problems, _ = read_table(path, Tier.USER)
    assert problems == [] and table is not None and len(table.rules) == 12_000


def test_aliases_beyond_the_first_occurrence_still_count_as_a_bomb() -> None:
    from quantreg.table.located import MAX_NODES

    rows = ", ".join(["*a"] * (MAX_NODES // 100 + 1))
    text = "version: 1\nrules: []\nx: &a [" + ", ".join(["1"] * 99) + "]\ny: [" + rows + "]\n"
    _, problems, _ = parse_table(text, "bomb.yaml", Tier.USER)
    assert len(problems) == 1 and "alias bomb" in problems[0].message and problems[0].line == 4


def test_a_rule_repeated_through_an_alias_is_reported_at_the_alias() -> None:
    text = "version: 1\nrules:\n  - &r {match: {device: cpu}, method: vllm}\n  - note\n  - *r\n"
    table, problems, _ = parse_table(text, "t.yaml", Tier.USER)
    assert [(p.line, p.key) for p in problems] == [(4, "rules[1]")]
    text = "version: 1\nrules:\n  - &r\n    match: {device: cpu}\n    method: vllm\n\n  - *r\n"
    table, problems, _ = parse_table(text, "t.yaml", Tier.USER)
    assert problems == [] and table is not None
    assert [r.line for r in table.rules] == [3, 7]


# -- from test_hardening.py (strict vs lenient, fault isolation, security) --------------------


def test_python_object_tag_is_rejected(tmp_path: Path) -> None:
    evil = tmp_path / "evil.yaml"
    evil.write_text("version: 1\nrules:\n  - match: !!python/object/apply:os.system ['echo pwned']\n"
                    "    method: vllm\n")
    out = subprocess.run([str(QUANTREG), "validate", str(evil)], capture_output=True, text=True)
    assert out.returncode == 1 and "pwned" not in out.stdout + out.stderr
    assert f"{evil}:3: rules[0].match: tag 'tag:yaml.org,2002:python/object/apply:os.system' is not allowed" \
        in out.stdout
