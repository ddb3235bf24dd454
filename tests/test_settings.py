"""The one ``QUANTREG_*`` settings table (issue 24 class 3) and run settings that never kill a lenient start
(issue 21 class 1).

The table is checked against the code (an AST walk: no ``QUANTREG_`` name spelt outside
quantreg/settings.py) and the docs (every name in docs/operating.md); the run settings through
the real parser and, once, through vLLM's real ``load_general_plugins()`` in a spawned
``EngineCore`` child (the probe of tests/test_vllm_startup.py).

Also here (issue 24 class 5): the timeout and MXFP4-compile settings, from test_containment_plugins.py
(issue 12, plugin and start-up classes) (class 8).
"""

from __future__ import annotations

import ast
import re
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from quantreg import Registry, settings
from quantreg.loading import setting_problems
from quantreg.problems import QuantregError
from quantreg.vllm.context import RunSettings, parse_run_settings, report_problems

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "quantreg"
NAME = re.compile(r"^QUANTREG_[A-Z0-9_]+$")


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def test_no_module_spells_a_setting_name_outside_the_table() -> None:
    """Every ``QUANTREG_*`` name used as a value in quantreg/ comes from quantreg.settings."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "settings.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip \
                    and NAME.match(node.value):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert offenders == [], offenders


def test_no_module_reads_the_environment_for_a_quantreg_name_but_the_table() -> None:
    """``os.environ.get(X)`` / ``os.getenv(X)`` / ``env[X]`` with X a QUANTREG_ literal: only in settings.py."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "settings.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            args: list[ast.expr] = []
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("get", "getenv", "pop", "setdefault"):
                args = node.args[:1]
            elif isinstance(node, ast.Subscript):
                args = [node.slice]
            for arg in args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("QUANTREG_"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == [], offenders


def test_every_setting_is_documented_once_in_the_settings_section() -> None:
    text = (ROOT / "docs" / "operating.md").read_text(encoding="utf-8")
    section = text.split("## Settings", 1)[1].split("\n## ", 1)[0]
    for setting in settings.SETTINGS:
        assert f"| `{setting.name}` |" in section, setting.name
        assert setting.help, setting.name
    assert len(settings.BY_NAME) == len(settings.SETTINGS)  # no name declared twice


def test_unknown_quantreg_names_are_not_errors_and_unknown_reads_are() -> None:
    env = {"QUANTREG_CPU_MXFP4_ISA": "avx2", "QUANTREG_WHATEVER": "x"}
    assert settings.problems(env) == []
    with pytest.raises(KeyError):
        settings.raw("QUANTREG_CPU_MXFP4_ISA", env)  # a plugin reads its own names itself


def test_multinode_ships_every_setting_by_prefix() -> None:

    assert all(name.startswith(settings.PREFIX) for name in settings.shipped_names())
    assert set(settings.shipped_names()) == set(settings.BY_NAME)


@hsettings(max_examples=200, deadline=None)
@given(st.sampled_from([s.name for s in settings.SETTINGS]), st.text(max_size=60))
def test_every_parser_takes_any_text_without_raising(name: str, text: str) -> None:
    value, message = settings.parsed(name, {name: text})
    assert message is None or (isinstance(message, str) and "\n" not in message)
    if message is not None and name != settings.STRICT:
        assert value == settings.BY_NAME[name].default


def test_strict_words() -> None:
    for word in ("1", "true", "YES", " on "):
        assert settings.parsed(settings.STRICT, {settings.STRICT: word}) == (True, None)
    for word in ("", "0", "false", "No", "off"):
        assert settings.parsed(settings.STRICT, {settings.STRICT: word}) == (False, None)
    value, message = settings.parsed(settings.STRICT, {settings.STRICT: "maybe"})
    assert value is True and message is not None and "counted as strict" in message


# -- run settings: additional_config["quantreg"] ------------------------------------------------

RUN_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)


@hsettings(max_examples=300, deadline=None)
@given(st.one_of(RUN_VALUES, st.dictionaries(st.sampled_from(["config", "strict", "confg", "Strict", "x"]),
                                             RUN_VALUES, max_size=4)))
def test_run_settings_never_raise_and_only_true_is_strict(raw: object) -> None:
    run = parse_run_settings(raw)
    assert isinstance(run, RunSettings)
    assert all(isinstance(p, str) and p for p in run.config)
    strict_asked = isinstance(raw, dict) and (raw.get("strict") is True or (
        isinstance(raw.get("strict"), str) and str(raw.get("strict")).strip().lower() in settings.TRUE_WORDS))
    assert (run.strict is True) == strict_asked
    for problem in run.problems:
        assert "\n" not in str(problem) and str(problem).startswith("vLLM additional_config: quantreg")


def test_false_words_are_false_and_bad_pieces_are_dropped_alone() -> None:
    for word in ("false", "no", "0", "off", "False"):
        run = parse_run_settings({"strict": word})
        assert run.strict is False and len(run.problems) == 1
    run = parse_run_settings({"config": ["a.yaml", 5, "", "b.yaml"], "strict": "perhaps", "confg": 1})
    assert run.config == ("a.yaml", "b.yaml") and run.strict is None
    keys = sorted(p.key for p in run.problems)
    assert keys == ["quantreg.confg", "quantreg.config[1]", "quantreg.config[2]", "quantreg.strict"]
    assert parse_run_settings("/a/path.yaml").problems[0].key == "quantreg"


def test_problems_warn_once_when_lenient_and_raise_when_strict(caplog: pytest.LogCaptureFixture) -> None:
    run = parse_run_settings({"confg": ["x"], "strict": "nope-unique-word"})
    with caplog.at_level("WARNING", logger="vllm.quantreg"):
        report_problems(run, strict=False)
        report_problems(run, strict=False)
    lines = [r.getMessage() for r in caplog.records if "additional_config" in r.getMessage()]
    assert len(lines) == 2 and all(x.startswith("quantreg: vLLM additional_config: quantreg.") for x in lines)
    with pytest.raises(QuantregError, match=r"quantreg\.confg: unknown key"):
        report_problems(run, strict=True)


@pytest.mark.vllm
def test_malformed_run_settings_do_not_stop_a_lenient_engine_core(tmp_path: Path) -> None:
    """vLLM's real plugin loading in a spawned EngineCore: warnings, the good run table still read, exit 0."""
    from test_vllm_startup import ROUTE, result_of, run_probe

    route = tmp_path / "route.yaml"
    route.write_text(ROUTE)
    out = run_probe(tmp_path, {"quantreg": {"config": [str(route), 7], "strict": "false", "confg": {}}}, "child")
    log = out.stdout + out.stderr
    assert "CHILD EXIT 0" in out.stdout, log[-4000:]
    data = result_of(out)
    tables = data["tables"]
    assert isinstance(tables, list) and tables[-1] == [str(route), "run"]
    assert "(strict)" not in log and "Traceback" not in log, log[-4000:]
    for key in ("quantreg.config[1]", "quantreg.strict", "quantreg.confg"):
        assert sum(f"vLLM additional_config: {key}" in x and "WARNING" in x for x in log.splitlines()) == 1, key


# -- from test_containment_plugins.py (issue 12, plugin and start-up classes) -----------------


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("raw,seconds", [("inf", threading.TIMEOUT_MAX), ("1e308", threading.TIMEOUT_MAX),
                                         ("0.5", 0.5), (" 3 ", 3.0), ("1e-9", 0.01), ("", 10.0)])
def test_timeouts_are_clamped_to_what_threading_allows(raw: str, seconds: float) -> None:
    assert settings.parsed(settings.PROBE_TIMEOUT, {"QUANTREG_PROBE_TIMEOUT": raw}) == (seconds, None)
    assert setting_problems({"QUANTREG_PROBE_TIMEOUT": raw}) == []


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("raw", ["nan", "-1", "0", "abc", "-inf", "1,5"])
def test_unreadable_timeouts_are_located_problems(raw: str) -> None:
    value, _ = settings.parsed(settings.PROBE_TIMEOUT, {"QUANTREG_PROBE_TIMEOUT": raw})
    [problem] = setting_problems({"QUANTREG_PROBE_TIMEOUT": raw})
    assert value == 10.0
    assert str(problem) == (f"environment: QUANTREG_PROBE_TIMEOUT: {raw!r} is not a positive number of seconds "
                            "(e.g. 10, 0.5, inf); using the default 10")


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("raw,gib", [("", 4.0), ("0", 0.0), (" 2.5 ", 2.5), ("12", 12.0)])
def test_the_split_memory_reserve_is_gib_and_zero_turns_it_off(raw: str, gib: float) -> None:
    assert settings.parsed(settings.SPLIT_MEMORY_RESERVE, {"QUANTREG_SPLIT_MEMORY_RESERVE": raw}) == (gib, None)


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("raw", ["-1", "abc", "nan", "inf", "4GB"])
def test_an_unreadable_split_memory_reserve_is_a_located_problem(raw: str) -> None:
    [problem] = setting_problems({"QUANTREG_SPLIT_MEMORY_RESERVE": raw})
    assert settings.value(settings.SPLIT_MEMORY_RESERVE, {"QUANTREG_SPLIT_MEMORY_RESERVE": raw}) == 4.0
    assert str(problem) == (f"environment: QUANTREG_SPLIT_MEMORY_RESERVE: {raw!r} is not a non-negative number "
                            "of GiB (e.g. 4, 0.5, 0); using the default 4")


@pytest.mark.usefixtures("clean_env")
def test_mxfp4_compile_setting_is_checked_at_load() -> None:
    registry = Registry.build(env={"QUANTREG_MXFP4_COMPILE": "fast"}, entry_points=False)
    assert [str(p) for p in registry.problems] == [
        "environment: QUANTREG_MXFP4_COMPILE: 'fast' is not one of auto, 0, 1"]
    assert Registry.build(env={"QUANTREG_MXFP4_COMPILE": " Auto "}, entry_points=False).problems == ()
