"""The decisions trail (QUANTREG_DECISIONS): real files, real concurrent writer processes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from quantreg import audit, settings
from quantreg.keys import Key
from quantreg.registry import Registry
from quantreg.vllm import startup

pytestmark = pytest.mark.usefixtures("clean_env")

ROOT = Path(__file__).resolve().parents[1]
USER_TABLE = """\
version: 1
rules:
  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}
    method: vllm
    note: the audit test's table
"""

WRITER = textwrap.dedent("""
    import sys
    from quantreg import audit
    from quantreg.registry import Registry
    table, trail, role, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    registry = Registry.build(config=[table], entry_points=False)
    decision = registry.resolve(("gpt_oss_mxfp4", "gpt_oss", "cpu"))
    fp = registry.fingerprint()
    for i in range(count):
        assert audit.record(decision, role=role, layer_count=i + 1, strict=False, fingerprint=fp, path=trail)
""")


def _decision(tmp_path: Path) -> tuple[Registry, Path]:
    table = tmp_path / "user.yaml"
    table.write_text(USER_TABLE)
    return Registry.build(config=[table], entry_points=False), table


def test_line_has_every_field_and_the_rule(tmp_path: Path) -> None:
    registry, table = _decision(tmp_path)
    decision = registry.resolve(Key("gpt_oss_mxfp4", "gpt_oss", "cpu"))
    trail = tmp_path / "d.jsonl"
    assert audit.record(decision, role="Worker_TP0", layer_count=24, strict=True, fingerprint="abc", path=trail)
    line = json.loads(trail.read_text())
    assert tuple(line) == audit.FIELDS
    assert line["pid"] == os.getpid() and line["role"] == "Worker_TP0"
    assert line["key"] == {"quant_format": "gpt_oss_mxfp4", "model_type": "gpt_oss", "device": "cpu"}
    assert line["method"] == "vllm" and line["rule"] == f"{table}:3"
    assert (line["layers"], line["strict"], line["fingerprint"]) == (24, True, "abc")
    assert line["time"].endswith("Z")


def test_env_variable_names_the_file_and_unset_means_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registry, _ = _decision(tmp_path)
    decision = registry.resolve(Key("gpt_oss_mxfp4", "gpt_oss", "cpu"))
    monkeypatch.delenv(settings.DECISIONS, raising=False)
    assert audit.record(decision) is False
    trail = tmp_path / "env.jsonl"
    monkeypatch.setenv(settings.DECISIONS, str(trail))
    assert audit.record(decision, fingerprint="f") is True
    assert json.loads(trail.read_text())["role"] == "MainProcess"  # no vLLM in this process


def test_role_is_the_name_vllm_logs_under(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_logger = type(sys)("vllm.logger")
    fake_logger._vllm_process_info = ("Worker_TP1_EP1", os.getpid())  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.logger", fake_logger)
    assert startup.process_role() == "Worker_TP1_EP1"
    fake_logger._vllm_process_info = ("EngineCore", os.getpid() + 1)  # type: ignore[attr-defined]  # a parent's
    assert startup.process_role() == "MainProcess"


def test_unwritable_file_warns_once_and_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    registry, _ = _decision(tmp_path)
    decision = registry.resolve(Key("gpt_oss_mxfp4", "gpt_oss", "cpu"))
    target = tmp_path / "no-such-dir" / "d.jsonl"
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg.audit"):
        for _ in range(3):
            assert audit.record(decision, fingerprint="f", path=target) is False
    warnings = [r for r in caplog.records if r.name == "vllm.quantreg.audit"]
    assert len(warnings) == 1
    assert str(target) in warnings[0].getMessage() and "cannot open" in warnings[0].getMessage()


def test_concurrent_writers_never_interleave(tmp_path: Path) -> None:
    """Six real processes append 300 lines each (roles padded to ~1.5 KB lines) at the same time."""
    _, table = _decision(tmp_path)
    trail = tmp_path / "concurrent.jsonl"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    roles = [f"Worker_TP{i}_" + chr(ord("a") + i) * 1500 for i in range(6)]
    procs = [subprocess.Popen([sys.executable, str(script), str(table), str(trail), role, "300"], env=env)
             for role in roles]
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * 6
    data = trail.read_bytes()
    assert data.endswith(b"\n")
    lines = data.split(b"\n")[:-1]
    assert len(lines) == 6 * 300
    seen: dict[str, list[int]] = {}
    for raw in lines:
        item = json.loads(raw)  # an interleaved line would not parse
        assert item["role"] in roles
        seen.setdefault(item["role"], []).append(item["layers"])
    assert {r: sorted(v) for r, v in seen.items()} == {r: list(range(1, 301)) for r in roles}
    summary = audit.summarise(trail)
    assert summary.ok and summary.lines == 1800
    assert [len(v) for v in summary.keys.values()] == [6]  # one choice per process


def _write_lines(path: Path, items: list[dict[str, object]], tail: bytes = b"") -> None:
    path.write_bytes(b"".join(json.dumps(i).encode() + b"\n" for i in items) + tail)


def _item(pid: int, role: str, method: str, fingerprint: str = "f1") -> dict[str, object]:
    return {"time": "2026-12-01T00:00:00.000Z", "pid": pid, "role": role,
            "key": {"quant_format": "gpt_oss_mxfp4", "model_type": "gpt_oss", "device": "cpu"},
            "method": method, "rule": "my.yaml:3", "layers": 2, "strict": False, "fingerprint": fingerprint,
            "fallback": None}


def test_summarise_flags_processes_that_disagree(tmp_path: Path) -> None:
    trail = tmp_path / "d.jsonl"
    _write_lines(trail, [_item(10, "EngineCore", "mxfp4_reference"), _item(11, "Worker_TP0", "mxfp4_reference"),
                         _item(12, "Worker_TP1", "vllm", fingerprint="f2")])
    summary = audit.summarise(trail)
    assert not summary.ok
    assert len(summary.disagreements) == 2
    methods, tables = summary.disagreements
    assert "different methods" in methods and "vllm: Worker_TP1 pid 12" in methods
    assert "mxfp4_reference: EngineCore pid 10, Worker_TP0 pid 11" in methods
    assert "different tables" in tables and "f2: Worker_TP1 pid 12" in tables
    text = summary.render()
    assert "DISAGREE" in text and "(gpt_oss_mxfp4, gpt_oss, cpu)" in text
    assert summary.to_json()["processes"] == 3


def test_summarise_tolerates_a_truncated_last_line(tmp_path: Path) -> None:
    trail = tmp_path / "d.jsonl"
    _write_lines(trail, [_item(10, "EngineCore", "vllm"), _item(11, "Worker", "vllm")], tail=b'{"time": "2026-')
    summary = audit.summarise(trail)
    assert summary.lines == 3 and not summary.disagreements  # every line of the file counts, the cut one too
    assert summary.problems == [f"{trail}:3: last line is cut short (a writer was stopped mid-line or is still "
                                "writing); ignored"]
    garbage = tmp_path / "g.jsonl"
    garbage.write_bytes(b"not json\n" + json.dumps(_item(1, "Worker", "vllm")).encode() + b"\n")
    found = audit.summarise(garbage)
    assert found.lines == 2 and found.problems[0].startswith(f"{garbage}:1: not a decision line")


def test_summarise_missing_file_is_a_problem_not_a_traceback(tmp_path: Path) -> None:
    summary = audit.summarise(tmp_path / "missing.jsonl")
    assert summary.problems and "cannot read" in summary.problems[0] and not summary.keys
    empty = tmp_path / "empty.jsonl"
    _write_lines(empty, [])
    assert not summary.readable and audit.summarise(empty).readable  # an empty trail is read: nothing yet


@pytest.mark.parametrize("make", ["missing", "directory"])
def test_doctor_decisions_on_a_trail_it_cannot_read_exits_1(make: str, tmp_path: Path) -> None:
    """``doctor --decisions missing.jsonl`` printed "0 line(s)" and exited 0: a wrong path looked fine."""
    import argparse

    from quantreg.doctor import _doctor_decisions

    trail = tmp_path / "trail.jsonl"
    if make == "directory":
        trail.mkdir()
    lines: list[str] = []
    assert _doctor_decisions(argparse.Namespace(decisions=str(trail)), {}, lines) == 1
    assert f"{trail}: cannot read: " in "\n".join(lines)


def test_verify_lines_share_the_trail_without_counting_as_decisions(tmp_path: Path) -> None:
    """``verify:`` comparisons go to the same trail (one write per line) but are not decisions:
    a process's verify line must not read as a second, fingerprint-less choice for its key."""
    from quantreg import audit

    trail = tmp_path / "d.jsonl"
    line = {"event": "verify", "pid": 7, "prefix": "model.layers.0.mlp.experts",
            "key": {"quant_format": "gpt_oss_mxfp4", "model_type": "gpt_oss", "device": "cpu"},
            "method": "mxfp4_reference", "against": "float64", "call": 1, "error": 0.005, "tolerance": 0.02}
    assert audit.append_record({**line, "ok": True}, path=trail)
    assert audit.append_record({**line, "call": 2, "error": 0.5, "ok": False}, path=trail)
    summary = audit.summarise(trail)
    assert summary.lines == 2 and summary.keys == {} and summary.disagreements == []
    assert summary.events == {"verify": 2} and summary.exceedances == 1 and not summary.ok
    assert "1 EXCEED, worst error 0.5, tolerance 0.02" in summary.render()


def _verify(pid: int, layer: int, call: int, error: object, ok: bool) -> dict[str, object]:
    return {"event": "verify", "time": "2026-12-01T00:00:00.000Z", "pid": pid,
            "prefix": f"model.layers.{layer}.mlp.experts",
            "key": {"quant_format": "gpt_oss_mxfp4", "model_type": "gpt_oss", "device": "cpu"},
            "method": "nibbles_swapped", "against": "mxfp4_reference", "phase": "live", "call": call,
            "error": error, "tolerance": 0.02, "ok": ok}


def test_doctor_decisions_one_line_per_verified_layer_and_exit_1_on_exceedance(tmp_path: Path) -> None:
    """9 lines: 2 decisions, 7 verify lines over two layers (one of them exceeding 3 times): the
    summary counts 9 lines, prints one line per layer with rounded floats, and doctor exits 1."""
    import argparse

    from quantreg.doctor import _doctor_decisions

    trail = tmp_path / "d.jsonl"
    items = [_item(10, "EngineCore", "nibbles_swapped"), _item(11, "Worker_TP0", "nibbles_swapped")]
    items += [_verify(11, 0, c, 0.001234567891, True) for c in (1, 2, 3, 4)]
    items += [_verify(11, 1, c, e, False) for c, e in ((1, 0.123456789), (2, 0.31415926535), (3, 0.2))]
    _write_lines(trail, items)
    assert len(trail.read_text().splitlines()) == 9
    data: dict[str, object] = {}
    lines: list[str] = []
    assert _doctor_decisions(argparse.Namespace(decisions=str(trail)), data, lines) == 1
    text = "\n".join(lines)
    assert f"decisions {trail}: 9 line(s), 1 key(s), 2 process(es)" in text
    assert ("  verify model.layers.0.mlp.experts: nibbles_swapped vs mxfp4_reference: 4 call(s), all within, "
            "worst error 0.001235, tolerance 0.02") in text
    assert ("  verify model.layers.1.mlp.experts: nibbles_swapped vs mxfp4_reference: 3 call(s), 3 EXCEED, "
            "worst error 0.3142, tolerance 0.02") in text
    assert "0.31415926535" not in text and "VERIFY: 3 comparison(s) exceeded their tolerance" in text
    layers = data["decisions"]["verified"]  # type: ignore[index]
    assert [(v["prefix"], v["calls"], v["exceedances"]) for v in layers] == [
        ("model.layers.0.mlp.experts", 4, 0), ("model.layers.1.mlp.experts", 3, 3)]
    within = tmp_path / "ok.jsonl"
    _write_lines(within, items[:6])
    assert _doctor_decisions(argparse.Namespace(decisions=str(within)), {}, []) == 0


def test_trail_is_strict_json_with_one_time_format(tmp_path: Path) -> None:
    """A non-finite verify error is written as a string (``jq`` reads the trail); times are ISO-8601
    UTC with ms; the reader still takes an old trail's Unix float time; terminal output is escaped."""
    trail = tmp_path / "d.jsonl"
    assert audit.append_record(_verify(3, 0, 1, float("inf"), False), path=trail)
    assert audit.append_record({**_verify(3, 0, 2, float("nan"), False), "extra": [float("-inf")]}, path=trail)
    for raw in trail.read_text().splitlines():  # strict JSON: the standard parser without NaN/Infinity
        json.loads(raw, parse_constant=lambda name: pytest.fail(f"bare {name} in the trail"))
    first, second = (json.loads(raw) for raw in trail.read_text().splitlines())
    assert (first["error"], second["error"], second["extra"]) == ("Infinity", "NaN", ["-Infinity"])
    assert "worst error inf" in audit.summarise(trail).render()
    old = tmp_path / "old.jsonl"
    _write_lines(old, [{**_item(5, "Worker\x1b[31mRED", "vllm"), "time": 1764547200.5}])
    summary = audit.summarise(old)
    [choice] = summary.keys["(gpt_oss_mxfp4, gpt_oss, cpu)"]
    assert choice.time == "2025-12-01T00:00:00.500Z" == audit.read_time(1764547200.5)
    assert audit.utc_time(0).endswith("Z") and audit.utc_time(0) == "1970-01-01T00:00:00.000Z"
    text = summary.render()
    assert "\x1b" not in text and r"Worker\x1b[31mRED" in text


def test_a_trail_path_with_a_newline_cannot_forge_a_log_line(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    target = tmp_path / "no-such-dir" / "x\nquantreg: FORGED line.jsonl"
    audit._warned.discard(str(target))
    with caplog.at_level("WARNING", logger="vllm.quantreg.audit"):
        assert audit.append_record({"event": "verify"}, path=target) is False
    [message] = [r.getMessage() for r in caplog.records if r.name == "vllm.quantreg.audit"]
    assert "\n" not in message and "x\\nquantreg: FORGED" in message


@pytest.mark.parametrize("kind", ["missing", "fifo", "directory"])
def test_doctor_on_a_trail_nobody_could_read_is_exit_1_not_a_pass(tmp_path: Path, kind: str) -> None:
    """Issue 21, class 7: "0 lines, no disagreement" about an unread file would pass a mistyped path."""
    trail = tmp_path / "trail.jsonl"
    if kind == "fifo":
        os.mkfifo(trail)
    elif kind == "directory":
        trail.mkdir()
    out = subprocess.run([sys.executable, "-m", "quantreg", "doctor", "--decisions", str(trail)], capture_output=True,
                         text=True, timeout=120, stdin=subprocess.DEVNULL)  # a FIFO must not hang it
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"warning: {trail}: cannot read: " in out.stdout
    assert not audit.summarise(trail).readable and not audit.summarise(trail).ok
