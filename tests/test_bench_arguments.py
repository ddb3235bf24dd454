"""Every numeric argument of every bench script, with bad values: exit 2, one line naming it (issue 53, class 6).

The arguments are found, not listed: every ``add_argument`` of every ``bench/*.py`` is read from
the source (``ast``), a ``type=int``/``float`` is refused outright (it would take ``-1`` and quote
5,000 digits), and each ``type=whole(low, high)`` / ``whole_list(low, high)`` gets the bad values
of its kind -- negative, zero where the low bound is above it, not a number, empty, 5,000 digits,
and for lists a bad or empty item -- run as the user would (``python -m bench.<script>``). Then the
files a whole-model bench reads from ``--model``: a missing or truncated ``config.json``.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
REQUIRED = {"dense_decode_bench": ["MODEL"], "quality_exact": ["MODEL", "PROMPTS", "OUT_DIR"]}
"""Positional arguments a script needs before its options are read."""
HUGE = "9" * 5000


def numeric_arguments() -> list[tuple[str, str, str, int, int]]:
    """``(script, --option, "whole" | "whole_list", low, high)`` for every numeric option in bench/."""
    found = []
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument" and node.args and isinstance(node.args[0], ast.Constant)):
                continue
            option = str(node.args[0].value)
            kind = next((k.value for k in node.keywords if k.arg == "type"), None)
            if isinstance(kind, ast.Name):
                assert kind.id not in ("int", "float"), f"{path.name} {option}: type={kind.id}; use cli_args.whole"
            if (isinstance(kind, ast.Call) and isinstance(kind.func, ast.Name)
                    and kind.func.id in ("whole", "whole_list")):
                low, high = (eval(compile(ast.Expression(a), "<bound>", "eval"), {"__builtins__": {}})
                             for a in kind.args)
                found.append((path.stem, option, kind.func.id, low, high))
    return found


def bad_values(kind: str, low: int) -> list[str]:
    values = ["-1", "four", "", HUGE, "1.5"]
    if low > 0:
        values.append("0")
    if kind == "whole_list":
        values += ["1,four", "1,,2", "1,", f"1,{HUGE}"]
    return values


CASES = [(script, option, value) for script, option, kind, low, _ in numeric_arguments()
         for value in bad_values(kind, low)]


def run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", f"bench.{script}", *REQUIRED.get(script, []), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def assert_one_line(done: subprocess.CompletedProcess[str], names: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert names in lines[0] and len(lines[0]) < 400, lines[0]


def test_the_walk_finds_the_arguments_the_issue_named() -> None:
    options = {(script, option) for script, option, *_ in numeric_arguments()}
    assert {("serving_bench", "--clients"), ("wholemodel_bench", "--layers"), ("serving_bench", "--threads"),
            ("wholemodel_bench", "--split-sequences"), ("dense_kernel_bench", "--tokens")} <= options
    assert len(CASES) >= 100


#: Bench modules whose top level imports the numeric stack (the quality bench's exact path and metrics): in an
#: environment without it (scripts/environments.sh core) they cannot start at all, before any argument.
NUMERIC_STACK = {"quality_bench": ("numpy",), "quality_exact": ("numpy", "torch")}


@pytest.mark.parametrize(("script", "option", "value"), CASES)
def test_a_bad_numeric_argument_is_one_line_naming_it(script: str, option: str, value: str) -> None:
    missing = [m for m in NUMERIC_STACK.get(script, ()) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"bench.{script} imports {', '.join(missing)} at its top: not installed")
    assert_one_line(run(script, f"{option}={value}"), f"argument {option}")


def test_max_out_below_min_out_is_one_line() -> None:
    assert_one_line(run("serving_bench", "--min-out", "64", "--max-out", "8"), "argument --max-out")


@pytest.mark.parametrize("script", ["serving_bench", "wholemodel_bench"])
@pytest.mark.parametrize("config", [None, '{"vocab_size": 201088, "num_local', "[1, 2]",
                                    '{"vocab_size": "big", "num_experts_per_tok": 4, "num_local_experts": 32}'])
def test_a_checkpoint_without_a_readable_config_is_one_line_naming_model(script: str, config: str | None,
                                                                         tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    if config is not None:
        (model / "config.json").write_text(config)
    done = run(script, "--model", str(model), "--work-dir", str(tmp_path / "work"))
    assert_one_line(done, "argument --model")
    assert "config.json" in done.stderr
