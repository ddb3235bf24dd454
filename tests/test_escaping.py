"""One escaping function (quantreg.problems.printable) for every outside string that reaches a terminal or log.

Class 14 of docs/reliability.md. Two layers:

- a property over the string SOURCES: a table field (``tuned:`` evidence shown by ``explain``), an
  environment value (``QUANTREG_STRICT`` in the mode label), a file's contents (plugin #2's
  build-failure record in its probe reason) and distribution metadata (a plugin's ``Name`` in
  ``quantreg plugins``), each given text with a control character, a line separator or an escape
  sequence followed by a forged ``WARNING`` line: no output line may start with the forgery, and
  no raw control character but the line ends may reach the output;
- a code walk over every print / log / stream-write call site in quantreg/: each value formatted
  into the text is either passed through ``printable`` (or a function that applies it), a number,
  or named in :data:`TRUSTED` with the reason it cannot hold outside text.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from core_support import PluginSite
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantreg import cli
from quantreg.methods import run_probe

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "quantreg"
FORGED = "WARNING quantreg: forged"
#: What may precede a forged line: every kind of line break or terminal control a value could carry.
BREAKS = ["\n", "\r", "\r\n", "\x1b[2K\r", "\x0b", "\x0c", "\x85", "\u2028", "\u2029", "\x00", "\x7f"]
#: Any of these left raw in output can split or rewrite a line.
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def _run(argv: list[str]) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main(argv)
        except SystemExit:
            pass
    return out.getvalue() + err.getvalue()


def _assert_not_forged(text: str, source: str) -> None:
    assert not any(line.lstrip().startswith(FORGED) for line in text.split("\n")), (source, text[-3000:])
    assert RAW.search(text) is None, (source, repr(RAW.search(text)), text[-3000:])


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("QUANTREG_CONFIG", "QUANTREG_STRICT", "QUANTREG_PLUGINS", "QUANTREG_DISABLE_PLUGINS",
                 "QUANTREG_HOST_CPU_FLAGS"):
        monkeypatch.delenv(name, raising=False)
    yield


def _tuned_table(path: Path, text: str) -> Path:
    value = json.dumps(text)  # a YAML double-quoted scalar holds any character
    path.write_text(textwrap.dedent(f"""\
        version: 1
        rules:
          - match: {{quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}}
            method: [mxfp4_reference]
            tuned:
              at: {value}
              host: {{kind: {value}, cores: 2}}
              results:
                - {{method: mxfp4_reference, ok: true, ms: {{"1": 1.5}}}}
                - {{method: other_method, ok: false, error: {value}}}
        """), encoding="utf-8")
    return path


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=st.text(max_size=8), brk=st.sampled_from(BREAKS))
def test_a_tuned_field_never_forges_a_line_in_explain(tmp_path_factory: pytest.TempPathFactory, clean: None,
                                                       before: str, brk: str) -> None:
    table = _tuned_table(tmp_path_factory.mktemp("t") / "tuned.yaml", f"{before}{brk}{FORGED}")
    text = _run(["explain", "gpt_oss_mxfp4", "gpt_oss", "cpu", "--config", str(table)])
    assert "tuned" in text
    _assert_not_forged(text, "tuned:")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=st.sampled_from(["1", "yes", "maybe", ""]), brk=st.sampled_from(BREAKS))
def test_the_strict_value_never_forges_a_line(monkeypatch: pytest.MonkeyPatch, clean: None, before: str,
                                               brk: str) -> None:
    monkeypatch.setenv("QUANTREG_STRICT", f"{before}{brk}{FORGED}".replace("\x00", "\\0"))  # env holds no NUL
    text = _run(["explain", "gpt_oss_mxfp4", "gpt_oss", "cpu"]) + _run(["rules"])
    _assert_not_forged(text, "QUANTREG_STRICT")


@settings(max_examples=25, deadline=None)
@given(before=st.text(max_size=8), brk=st.sampled_from(BREAKS))
def test_a_probe_reason_from_a_file_never_forges_a_line(before: str, brk: str) -> None:
    """Plugin #2's probe quotes its BUILD_FAILED.txt; any probe's reason is escaped where quantreg takes it."""
    reason = run_probe(lambda: (False, f"the build failed: {before}{brk}{FORGED}"), 5.0).reason
    _assert_not_forged(reason, "probe reason")


def test_plugin_2_build_failure_file_is_escaped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probe = pytest.importorskip("quantreg_cpu_mxfp4.probe")
    record = tmp_path / "BUILD_FAILED.txt"
    record.write_text(f"g++ failed\n{FORGED}\x1b[31m", encoding="utf-8")
    monkeypatch.setattr(probe, "BUILD_FAILED", record)
    monkeypatch.setattr(probe, "LIBRARY", tmp_path / "libquantreg_cpu_mxfp4.so")  # not built
    reason = run_probe(probe.kernel_available, 5.0).reason
    assert "g++ failed" in reason
    _assert_not_forged(reason, "BUILD_FAILED.txt")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(brk=st.sampled_from([b for b in BREAKS if "\n" not in b and "\r" not in b and b != "\x00"]))
def test_a_distribution_name_never_forges_a_line(tmp_path_factory: pytest.TempPathFactory,
                                                  monkeypatch: pytest.MonkeyPatch, clean: None, brk: str) -> None:
    root = tmp_path_factory.mktemp("site")
    monkeypatch.syspath_prepend(str(root))
    site = PluginSite(root)
    site.add(f"qrt-evil{brk}{FORGED}", {"qrt_evil": "qrt_evil_mod"},
             modules={"qrt_evil_mod": "from quantreg import hookimpl\n"})
    text = _run(["plugins"]) + _run(["doctor"])
    assert "qrt-evil" in text
    _assert_not_forged(text, "METADATA Name")


# --- every print / log / write call site ---------------------------------------------------------------------

#: Functions whose result is escaped (they apply printable to what they format, or return only trusted text).
ESCAPERS = {"printable", "name_list", "problem_json", "json.dumps", "len", "int", "float", "round", "bool",
            "type_name", "phase_text", "left_out_lines", "repr", "os.getpid", "describe"}
LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical"}

#: (file, expression as written) -> why it is trusted (cannot hold unescaped outside text).
TRUSTED: dict[tuple[str, str], str] = {
    ('quantreg/cli.py', 'args.command'):
        'a subcommand name argparse accepted from its fixed choices',
    ('quantreg/cli.py', 'problem'):
        '_internal_error: built from describe(), which escapes',
    ('quantreg/commands/tables.py', 'fault'):
        'a Problem or PluginFailure: __str__ escapes path, key and message',
    ('quantreg/commands/tables.py', 'warning'):
        'did-you-mean / key / match warnings: values passed through printable where they are built '
        '(vllm/names.py, _match_warnings)',
    ('quantreg/commands/tools.py', 'warning'):
        'device_warnings: the device passed through printable where the line is built',
    ('quantreg/output.py', 'text'):
        "emit: JSON (json.dumps escapes) or a command's lines, each built from escaped values (Problem.__str__, printable, validated names)",  # noqa: E501
    ('quantreg/output.py', 'fault'):
        'a Problem or PluginFailure: __str__ escapes path, key and message',
    ('quantreg/output.py', 'refusal'):
        'envelope.refusal: mode reasons (QUANTREG_STRICT escaped in mode.py) and Problem strings',
    ('quantreg/cli.py', 'missing'):
        'missing_config: the path is printable()-escaped where the line is built',
    ('quantreg/demo/command.py', 'problem'):
        'stop(): every caller escapes the path with printable',
    ('quantreg/demo/command.py', 'text'):
        "say(): quantreg's own text, decisions (Decision.render) and numbers",
    ('quantreg/newplugin.py', 'problem'):
        "built from name_problem (quotes the name escaped) or '{shown}: reason' (shown is printable)",
    ('quantreg/newplugin.py', 'name'):
        "a name that passed name_problem: lower-case identifier letters, digits and '_'",
    ('quantreg/newplugin.py', 'shown'):
        'printable() of the directory',
    ('quantreg/newplugin.py', "subs['__DIST__']"):
        'derived from a validated name',
    ('quantreg/newplugin.py', "subs['__PACKAGE__']"):
        'derived from a validated name',
    ('quantreg/newplugin.py', "subs['__CLASS__']"):
        'derived from a validated name',
    ('quantreg/newplugin.py', "target / subs['__PACKAGE__'] / 'rules.yaml'"):
        'target passed dir_target_problem; printed as the next command to run',
    ('quantreg/plan.py', 'refusal'):
        'envelope.refusal (see cli.py refusal)',
    ('quantreg/plan.py', '\'\\n\'.join((printable(f"problem   {(p[\'text\'] if isinstance(p, Mapping) else p)}") for p in data[\'problems\']))'):  # noqa: E501
        'each line printable()-escaped inside the join',
    ('quantreg/plan.py', 'render(data, model_dir)'):
        "plan.render escapes the checkpoint's strings (printable) as it builds each line",
    ('quantreg/testing/api.py', 'fault'):
        'a Problem or PluginFailure: __str__ escapes',
    ('quantreg/testing/api.py', 'report.for_terminal(as_json=as_json)'):
        "the kit's report: JSON, or a table of check names and describe()d errors",
    ('quantreg/testing/vllm_child.py', "result['error']"):
        "the child's own traceback on its stderr, read by run_vllm into a log file, not a terminal",
    ('quantreg/tiny/command.py', 'serve_hint(out, bf16)'):
        "shlex.quote'd path and quantreg's own commands",
    ('quantreg/tiny/command.py', 'exc'):
        'a WriteRefused whose text quantreg.writing builds with printable',
    ('quantreg/tune/command.py', 'f"\\r\\x1b[2K[{\'#\' * filled}{\'.\' * (24 - filled)}] {elapsed:5.0f}s {step}"[:160]'):  # noqa: E501
        "the progress bar's own control sequence; step is printable()-escaped on entry to ProgressLine.__call__",
    ('quantreg/tune/command.py', 'step'):
        'printable()-escaped on entry to ProgressLine.__call__',
    ('quantreg/tune/command.py', 'text'):
        'the table tune rendered (yaml.safe_dump escapes non-printable characters)',
    ('quantreg/tune/command.py', "'\\n'.join(lines)"):
        'each line built with printable() around every outside value',
    ('quantreg/tune/dense.py', 'text'):
        'the table tune --layers rendered (yaml.safe_dump escapes non-printable characters)',
    ('quantreg/tune/dense.py', "'\\n'.join(summary_lines(answers, target, elapsed, budget))"):
        'each line built with printable() around every outside value (summary_lines)',
    ('quantreg/vllm/multinode.py', 'line'):
        'a QUANTREG_TABLES payload line quantreg encoded itself (JSON)',
    ('quantreg/vllm/startup.py', 'strict_text(error)'):
        'the strict one-liner: QuantregError text of Problem strings (escaped)',
}


def _escaped(expr: ast.expr) -> bool:
    if isinstance(expr, ast.Constant):
        return True
    if isinstance(expr, ast.Name) and expr.id.isupper():
        return True  # a module constant (MODULE, TABLES_ENV...): quantreg's own text
    if isinstance(expr, ast.Attribute) and expr.attr == "__name__":
        return True  # a type's or function's name: an identifier
    if isinstance(expr, ast.Call):
        name = ast.unparse(expr.func)
        return name in ESCAPERS or name.split(".")[-1] in ESCAPERS
    if isinstance(expr, ast.JoinedStr):
        return all(_escaped(v.value) or v.format_spec is not None
                   for v in expr.values if isinstance(v, ast.FormattedValue))
    return False


def _values(call: ast.Call) -> Iterator[ast.expr]:
    """The expressions a print/log/write call puts into the text."""
    func = call.func
    is_log = isinstance(func, ast.Attribute) and func.attr in LOG_METHODS
    for i, arg in enumerate(call.args):
        if isinstance(arg, ast.JoinedStr):
            yield from (v.value for v in arg.values if isinstance(v, ast.FormattedValue) and v.format_spec is None)
        elif is_log and i == 0:
            continue  # the %-format itself
        else:
            yield arg


def _is_site(node: ast.AST) -> bool:
    """A call that prints or writes to a terminal stream (log calls are escaped by their logger's filter)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name):
        return func.id == "print"
    if not isinstance(func, ast.Attribute):
        return False
    owner = ast.unparse(func.value)
    return func.attr == "write" and ("std" in owner or "stream" in owner)


def test_every_logger_escapes_its_messages() -> None:
    """Every logger quantreg logs through is made by quantreg_logger (the escaping filter): the log's one home."""
    made_elsewhere = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                    and ast.unparse(node.value.func) == "logging.getLogger" and rel != "quantreg/problems.py":
                made_elsewhere.append(f"{rel}:{node.lineno}")
    assert made_elsewhere == [], made_elsewhere


def test_a_log_line_is_one_line(caplog: pytest.LogCaptureFixture) -> None:
    from quantreg.problems import quantreg_logger

    with caplog.at_level("INFO", logger="vllm.quantreg"):
        quantreg_logger().warning("quantreg: table %s: %s", f"a{chr(10)}{FORGED}", ValueError(f"x\r{FORGED}"))
        quantreg_logger("vllm.quantreg.audit").warning(f"path {chr(0x2028)}{FORGED}")
    assert len(caplog.records) == 2
    for record in caplog.records:
        _assert_not_forged(record.getMessage(), "log")


def _sites() -> Iterator[tuple[str, int, str]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if _is_site(node):
                assert isinstance(node, ast.Call)
                for value in _values(node):
                    if not _escaped(value):
                        yield rel, node.lineno, ast.unparse(value)


def test_the_walk_sees_unescaped_values() -> None:
    tree = ast.parse('print(f"{a} {printable(b)} {n:.3g}", file=sys.stderr); print("x", c, printable(d)); '
                     'sys.stderr.write(e)')
    found = [ast.unparse(v) for n in ast.walk(tree) if _is_site(n) and isinstance(n, ast.Call) for v in _values(n)
             if not _escaped(v)]
    assert found == ["a", "c", "e"], found


def test_every_print_and_log_site_escapes_or_is_trusted() -> None:
    sites = list(_sites())
    offenders = [f"{rel}:{line}: {expr}" for rel, line, expr in sites if (rel, expr) not in TRUSTED]
    assert offenders == [], ("pass outside text through quantreg.problems.printable, or add (file, expression) "
                             "to TRUSTED with why it cannot hold outside text:\n" + "\n".join(offenders))
    stale = set(TRUSTED) - {(rel, expr) for rel, _, expr in sites}
    assert not stale, f"stale TRUSTED entries: {stale}"
