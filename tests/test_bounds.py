"""Every number a user can write is bounded before any work, with a located message (issue 46, class 5).

quantreg/bounds.py is the one bound; these properties draw numbers of every size and spelling -- huge
integers (past Python's 4,300-digit text limit), negative, zero, floats, non-finite values, digit strings
of thousands of digits, non-ASCII digits -- and put each where a user writes one: a table field
(``tokens:``, ``priority``, ``verify:`` counts, ``tuned:`` counts), a command-line argument (``tiny-model
--layers``/``--seed``, ``tune --budget``, ``check-method --shape``) and a config.json size read by ``plan``
and ``tune``. Each is either accepted (and then inside its documented range) or refused with one short
line naming where it was written and what was expected; never an exception, never Python's
``sys.set_int_max_str_digits`` text, never a number printed with all of its digits.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantreg import Registry, bounds, cli
from quantreg.plan import read_checkpoint

pytestmark = pytest.mark.usefixtures("clean_env")

LIMIT_TEXT = "Exceeds the limit"
#: Numbers of every size a hand edit or a hostile caller writes.
numbers = st.one_of(
    st.integers(-10, 10), st.integers(-2**70, 2**70),
    st.sampled_from([10**3000, -(10**3000), 10**4200, 2**31, 2**31 - 1]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans())
#: Numbers as text, as a command line or a ``tokens:`` bound spells them.
digit_texts = st.one_of(
    numbers.map(lambda n: str(n) if not isinstance(n, int) or abs(n) < 10**4000 else "9" * 5000),
    st.integers(1, 6000).map(lambda n: "9" * n), st.sampled_from(["²", "1e3", " 7", "0x10", "-0", "007", ""]))

#: table field -> (how the number is written into a rule, the key a refusal names)
TABLE_FIELDS: dict[str, tuple[Any, str]] = {
    "priority": (lambda r, v: r.update(priority=v), "rules[0].priority"),
    "verify.every": (lambda r, v: r.update(verify={"against": "float64", "every": v}), "rules[0].verify.every"),
    "verify.first": (lambda r, v: r.update(verify={"against": "float64", "first": v}), "rules[0].verify.first"),
    "verify.layers": (lambda r, v: r.update(verify={"against": "float64", "decoders": v}), "rules[0].verify.decoders"),
    "verify.layers[]": (lambda r, v: r.update(verify={"against": "float64", "decoders": [0, v]}),
                        "rules[0].verify.decoders"),
    "verify.tolerance": (lambda r, v: r.update(verify={"against": "float64", "tolerance": v}),
                         "rules[0].verify.tolerance"),
    "tuned.rounds": (lambda r, v: r.update(tuned={"results": [], "rounds": v}), "rules[0].tuned.rounds"),
    "tuned.budget_s": (lambda r, v: r.update(tuned={"results": [], "budget_s": v}), "rules[0].tuned.budget_s"),
    "tuned.pins.shape": (lambda r, v: r.update(tuned={"results": [], "pins": {"shape": {"experts": v}}}),
                         "rules[0].tuned.pins.shape"),
    "tuned.crossover": (lambda r, v: r.update(tuned={"results": [], "crossover": {"tokens": v, "small": "a",
                                                                                   "large": "b"}}),
                        "rules[0].tuned.crossover"),
}


def rule() -> dict[str, Any]:
    return {"match": {"quant_format": "gpt_oss_mxfp4", "device": "cpu"}, "method": "vllm"}


def refusals(tmp_path: Path, doc: dict[str, Any]) -> list[Any]:
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    registry = Registry.build(config=[path], env={}, entry_points=False)
    registry.resolve(("gpt_oss_mxfp4", "gpt_oss", "cpu"))  # a table that loads also decides
    return [p for p in registry.problems if p.path == str(path)]


def assert_short_and_plain(text: str) -> None:
    assert LIMIT_TEXT not in text and "Traceback" not in text and len(text) < 700, text[:800]  # (+ argparse usage)
    assert "9" * 41 not in text, text[:500]  # a value is quoted cut at 40 characters, a huge integer by its size


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(sorted(TABLE_FIELDS)), value=numbers)
def test_table_numbers_are_bounded_and_located(tmp_path: Path, field: str, value: Any) -> None:
    write, key = TABLE_FIELDS[field]
    item = rule()
    write(item, value)
    every = refusals(tmp_path, {"version": 1, "rules": [item]})
    for problem in every:  # (a verify: on 'vllm' is also refused, for another reason: said the same way)
        assert_short_and_plain(str(problem))
        assert problem.line is not None and str(problem.key).startswith(key.split(".")[0]), problem
    found = [p for p in every if str(p.key) == key]
    if field in ("priority",) and not found:
        assert abs(value) <= bounds.MAX_PRIORITY and not isinstance(value, bool)
    if field in ("verify.every", "tuned.rounds") and not found:
        assert isinstance(value, int) and 0 <= value <= bounds.MAX_COUNT


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(op=st.sampled_from(["<=", "<", ">", ">="]), digits=digit_texts)
def test_a_tokens_bound_of_any_size_is_a_located_problem_or_a_range(tmp_path: Path, op: str, digits: str) -> None:
    item = rule()
    item["match"]["tokens"] = f"{op}{digits}"
    found = refusals(tmp_path, {"version": 1, "rules": [item]})
    for problem in found:
        assert_short_and_plain(str(problem))
        assert str(problem.key) == "rules[0].match.tokens" and problem.line, problem
    if not found:
        assert digits.strip().isdigit() and 1 <= int(digits) <= bounds.MAX_COUNT


#: command line -> (arguments before the number, the option it is given to, its accepted range)
ARGUMENTS: dict[str, tuple[list[str], str, tuple[float, float]]] = {
    "tiny-model --layers": (["tiny-model", "d"], "--layers", (1, bounds.MAX_TINY_LAYERS)),
    "tiny-model --seed": (["tiny-model", "d"], "--seed", (0, bounds.MAX_COUNT)),
    "tune --budget": (["tune", "m"], "--budget", (0, bounds.MAX_BUDGET_S)),
    "check-method --shape": (["check-method", "x"], "--shape", (1, bounds.MAX_SIZE)),
}


@settings(max_examples=200, deadline=None, database=None)
@given(command=st.sampled_from(sorted(ARGUMENTS)), text=digit_texts)
def test_command_line_numbers_are_bounded_before_any_work(command: str, text: str) -> None:
    words, option, (low, high) = ARGUMENTS[command]
    if option == "--shape":
        text = f"{text},64,64"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = cli.build_parser().parse_args([*words, f"{option}={text}"])
        except SystemExit as exc:
            assert exc.code == 2
            args = None
    message = err.getvalue()
    assert_short_and_plain(message)
    if args is None:  # argparse's own usage line, naming the option and what was expected
        assert f"argument {option}: expected " in message, message
        return
    value = getattr(args, option.lstrip("-"))
    if option == "--shape":
        experts = int(text.split(",")[0])
        assert 2 <= experts <= high
    else:
        assert low <= value <= high and (option == "--budget" or isinstance(value, int)), value


CONFIG_SIZES = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_local_experts", "num_experts_per_tok",
                "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim")


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(CONFIG_SIZES), value=st.one_of(
    st.integers(-2**70, 2**70), st.sampled_from([10**4000, 0, -1, 2**20 + 1]),
    st.floats(allow_nan=False, allow_infinity=False), st.booleans()))
def test_config_json_sizes_are_bounded_where_plan_and_tune_read_them(tmp_path: Path, field: str, value: Any) -> None:
    config = {"model_type": "gpt_oss", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 64,
              "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, field: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ck = read_checkpoint(tmp_path)
    mine = [p for p in ck.problems if f": {field}: " in p]
    for problem in mine:
        assert_short_and_plain(problem)
        assert problem.startswith(f"{tmp_path / 'config.json'}: {field}: expected an integer from "), problem
    if not mine:
        assert type(value) is int and 0 <= value <= bounds.MAX_SIZE
        assert ck.config[field] == value


def test_a_tiny_model_of_a_million_layers_is_refused_before_torch(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:  # argparse's usage error: exit 2, before torch is imported
        cli.main(["tiny-model", str(tmp_path / "m"), "--layers", "1000000"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and not (tmp_path / "m").exists()
    assert (f"argument --layers: expected a layer count from 1 to {bounds.MAX_TINY_LAYERS}, got string '1000000'"
            in err), err


def test_shown_never_prints_a_huge_integer() -> None:
    assert bounds.shown(10**4299) == "an integer of about 4,300 digits"
    assert bounds.shown(10**5000).startswith("an integer of about 5,00")  # past Python's own limit: no str()
    assert bounds.shown(-3) == "integer -3" and bounds.shown("x" * 100).endswith("...'")
    with pytest.raises(argparse.ArgumentTypeError):
        cli._count_arg(1, 3, "a count")("4")
