"""Records one run wrote, read by another as untrusted input (issue 53, class 5).

Every record kind a command reads from disk that another run wrote, times every way such a file
goes wrong: terminal escapes, a newline that forges a line, fields of the wrong type, a file cut
short, a huge file, fields missing. The kinds: the kit's compile-check record (``doctor``'s
``compiled:`` lines), a ``QUANTREG_DECISIONS`` trail line (``doctor --decisions``) and a plugin's
``BUILD_FAILED.txt`` (its probe's reason). For each: nothing printed carries a control character or
a line the record chose, nothing corrupt is shown as a verdict ("yes"), and each non-conforming
record is one ``unreadable record <path>`` fault naming it. Then one real ``quantreg doctor`` run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from quantreg import audit
from quantreg.installed import build_failure
from quantreg.methods import Method
from quantreg.testing.compiled_record import MAX_RECORD, doctor_line, record, recorded

pytestmark = pytest.mark.usefixtures("clean_env")

FORGED = "ok\nquantreg: all methods safe"
ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b[H"
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x80-\x9f\u2028\u2029]")

#: corruption -> how it changes a JSON record's text (given the valid record as a dict)
CORRUPTIONS: dict[str, Callable[[dict[str, Any]], str]] = {
    "escapes": lambda r: json.dumps({**r, **{k: ESCAPES for k in r if isinstance(r[k], str) and k not in SAFE}}),
    "forged-newline": lambda r: json.dumps({**r, **{k: FORGED for k in r if isinstance(r[k], str) and k not in SAFE}}),
    "wrong-types": lambda r: json.dumps({k: [v] if not isinstance(v, list) else 5 for k, v in r.items()}),
    "truncated": lambda r: json.dumps(r)[: len(json.dumps(r)) // 2],
    "huge": lambda r: json.dumps({**r, "padding": "x" * (MAX_RECORD + 10)}),
    "missing-fields": lambda r: json.dumps({k: v for k, v in list(r.items())[:1]}),
}
SAFE = {"build", "status", "checked"}
"""Fields whose text decides whether the record applies: escaped text there makes it unreadable, tested apart."""
VERDICT_STANDS = {"escapes", "forged-newline"}
"""Corruptions of free text only: the record still reads, its text shown escaped."""


def assert_one_clean_line(text: str) -> None:
    assert "\n" not in text and CONTROL.search(text) is None, repr(text)
    assert "quantreg: all methods safe" not in text.split("\\n")[0] or text.count("\\n") >= 1


@pytest.fixture
def method(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Method:
    (tmp_path / "qrt_records_mod.py").write_text("class M:\n    pass\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("QUANTREG_CACHE_DIR", str(tmp_path / "cache"))
    sys.modules.pop("qrt_records_mod", None)
    return Method(name="qrt_records", target="qrt_records_mod:M", devices=("cpu",))


@pytest.mark.parametrize("status", ["PASS", "FAIL"])
@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_compile_record_is_checked_escaped_or_an_unreadable_fault(corruption: str, status: str, method: Method,
                                                                    tmp_path: Path) -> None:
    record(method, status, "equals eager" if status == "PASS" else "fullgraph failed at x.py:3")
    path = tmp_path / "cache" / "compiled" / "qrt_records.json"
    path.write_text(CORRUPTIONS[corruption](json.loads(path.read_text())), encoding="utf-8")
    seen = recorded(method)
    line = doctor_line(method, seen)
    assert_one_clean_line(line)
    if corruption in VERDICT_STANDS:
        assert seen["status"] == status
        if status == "FAIL":  # the detail is shown (a PASS line shows none): escaped, on the one line
            assert ("\\x1b" in line) if corruption == "escapes" else ("ok\\nquantreg: all methods safe" in line), line
    else:
        assert seen["status"] == "unreadable record", seen
        assert line.startswith(f"compiled:  qrt_records: not known: unreadable record {path}: "), line
        assert ": yes" not in line


@pytest.mark.parametrize("field", ["build", "status", "checked"])
def test_escapes_in_a_field_that_decides_make_the_record_unreadable(field: str, method: Method,
                                                                   tmp_path: Path) -> None:
    record(method, "PASS", "equals eager")
    path = tmp_path / "cache" / "compiled" / "qrt_records.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), field: FORGED + ESCAPES}), encoding="utf-8")
    line = doctor_line(method, recorded(method))
    assert_one_clean_line(line)
    assert "unreadable record" in line and f"field '{field}'" in line, line


GOOD_LINE = {"time": "2026-12-07T20:00:00.000Z", "pid": 4242, "role": "EngineCore",
             "key": {"quant_format": "fp8", "model_type": "llama", "device": "cpu"}, "method": "vllm",
             "rule": None, "layers": 3, "strict": False, "fingerprint": "abc123"}


def trail_line(corruption: str) -> str:
    item: dict[str, Any] = dict(GOOD_LINE)
    if corruption == "escapes":
        item.update(role=ESCAPES, method="m" + ESCAPES, fingerprint=ESCAPES)
    elif corruption == "forged-newline":
        item.update(role=FORGED, method=FORGED, key=FORGED)
    elif corruption == "wrong-types":
        item.update(pid="4242", method=["vllm"], strict="yes")
    elif corruption == "truncated":
        return json.dumps(item)[:40]  # no newline after it either: a writer killed mid-line
    elif corruption == "huge":
        item.update(method="m" * 5000)
    elif corruption == "missing-fields":
        del item["pid"], item["method"]
    return json.dumps(item) + "\n"


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_trail_line_is_checked_escaped_or_an_unreadable_fault(corruption: str, tmp_path: Path) -> None:
    trail = tmp_path / "trail.jsonl"
    trail.write_text(json.dumps(GOOD_LINE) + "\n" + trail_line(corruption), encoding="utf-8")
    summary = audit.summarise(trail)
    text = summary.render()
    assert CONTROL.search(text) is None, repr(text)
    assert not any(line.startswith("quantreg: all methods safe") for line in text.splitlines()), text
    if corruption in VERDICT_STANDS:
        assert summary.problems == [], summary.problems
    elif corruption == "truncated":
        assert summary.problems == [f"{trail}:2: last line is cut short (a writer was stopped mid-line or is still "
                                    "writing); ignored"]
    else:
        [problem] = summary.problems
        assert problem.startswith(f"unreadable record {trail}:2: field '"), problem
    assert "fp8" in text  # the good line still counts


def test_a_huge_trail_is_refused_by_size_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(audit, "MAX_TRAIL_BYTES", 1000)
    trail = tmp_path / "trail.jsonl"
    trail.write_text((json.dumps(GOOD_LINE) + "\n") * 20, encoding="utf-8")
    summary = audit.summarise(trail)
    assert not summary.readable and "cannot read" in summary.problems[0]


@pytest.mark.parametrize("corruption", ["escapes", "forged-newline", "huge", "truncated", "wrong-types",
                                        "missing-fields"])
def test_a_build_failure_record_is_one_escaped_bounded_line(corruption: str, tmp_path: Path) -> None:
    path = tmp_path / "BUILD_FAILED.txt"
    content = {"escapes": ESCAPES + "g++ failed", "forged-newline": FORGED, "huge": "x" * 100_000,
               "truncated": "g++: error: unrecognised optio", "wrong-types": "\xff\xfe binary \x00 bytes",
               "missing-fields": ""}[corruption]
    path.write_bytes(content.encode("utf-8", "surrogateescape") if corruption != "wrong-types"
                     else b"\xff\xfe binary \x00 bytes")
    said = build_failure(path)
    assert said is not None and len(said) <= 500
    assert_one_clean_line(said)


def test_quantreg_doctor_prints_a_hostile_compile_record_as_one_escaped_fault(tmp_path: Path) -> None:
    """The real command, in its own process: the record's forged line and escapes never reach the terminal."""
    from core_support import QUANTREG

    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    env["QUANTREG_CACHE_DIR"] = str(cache)
    names = json.loads(subprocess.run([str(QUANTREG), "list", "--json"], capture_output=True, text=True, env=env,
                                      timeout=300).stdout)
    method_names = [m["name"] for m in names.get("methods", []) if m.get("name") != "vllm"]
    if not method_names:
        pytest.skip("no registered method besides vLLM's own")
    (cache / "compiled").mkdir(parents=True)
    for name in method_names:
        (cache / "compiled" / f"{name}.json").write_text(json.dumps(
            {"build": ["x"], "status": "PASS", "detail": FORGED + ESCAPES, "checked": "2026-12-07 20:00:00"}))
    done = subprocess.run([str(QUANTREG), "doctor"], capture_output=True, text=True, env=env, timeout=300)
    assert "\x1b" not in done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert not any(line.startswith("quantreg: all methods safe") for line in lines), done.stdout
    compiled = [line for line in lines if line.startswith("compiled:  ")]
    assert len(compiled) == len(method_names), done.stdout
    assert all("unreadable record" in line and ": yes" not in line for line in compiled), compiled
