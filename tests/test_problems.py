"""quantreg.problems: what a problem looks like when printed: bounded did-you-mean suggestions and name
lists among ten thousand names, one escaped line for a path with a newline, any path on a strict UTF-8
stdout.

History (issue 24 class 5): moved from tests/test_containment_loader.py (issue 12, loader classes)
(classes 4 and 10).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from core_support import _bench_module, run_cli, run_register

from quantreg.registry import Registry
from quantreg.table.file import Tier, read_table

pytestmark = pytest.mark.usefixtures("clean_env")


# -- from test_containment_loader.py (issue 12, loader classes) -------------------------------


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
    _, problems, _ = read_table(path, Tier.USER)
    assert str(problems[0]).encode("utf-8")  # printable on a strict stream


# -- one form for strict refusals ------------------------------------------------------------


def test_strict_error_gives_one_prefixed_line_whatever_the_message() -> None:
    from quantreg.problems import STRICT_PREFIX, QuantregError, strict_error

    cases = {
        "quantreg: method 'm' could not be built": "quantreg (strict): method 'm' could not be built",
        "verify: layer 3: error 1.2": "quantreg (strict): verify: layer 3: error 1.2",
        "quantreg (strict): already": "quantreg (strict): already",
        "two\nlines": "quantreg (strict): two\\nlines",  # one line in vLLM's log, never a forged second
    }
    for message, expected in cases.items():
        error = strict_error(message)
        assert isinstance(error, QuantregError) and str(error) == expected
        assert str(error).startswith(STRICT_PREFIX) and "\n" not in str(error)


def _strict_spellings(path: Path) -> list[int]:
    """Lines of ``path`` where code (not a docstring or comment) spells strict's prefix itself."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return sorted({node.lineno for node in ast.walk(tree)
                   if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                   and ("quantreg (strict)" in node.value or node.value.rstrip().endswith("(strict)"))})


def test_every_strict_refusal_is_made_by_strict_error() -> None:
    """Three forms had grown (``quantreg: ...``, ``quantreg: ... (strict)``, ``quantreg (strict): ...``):
    the prefix is spelled only in quantreg/problems.py, every other site calls ``strict_error``."""
    root = Path(__file__).resolve().parents[1] / "quantreg"
    spelled = {str(p.relative_to(root)): lines for p in sorted(root.rglob("*.py"))
               if (lines := _strict_spellings(p))}
    assert set(spelled) == {"problems.py"}, spelled
    calls = [p for p in root.rglob("*.py") if "strict_error(" in p.read_text(encoding="utf-8")]
    assert len(calls) >= 8, calls  # the walk sees the sites it guards: it is not vacuous
