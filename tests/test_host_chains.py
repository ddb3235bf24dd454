"""Host-aware chains: a method that cannot run on this host is passed over, vLLM's own included.

Both kinds of CI host are exercised on any machine through the host-facts seam
(``quantreg.host.simulate``): in-process with the environment variable set, and in a child
``quantreg explain`` / ``plan`` (real console script, real YAML, the installed plugin #1 with
``mxfp4_reference``). Real vLLM on this host is in tests/e2e/test_host_chains_vllm.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from core_support import QUANTREG, REFERENCE, REFERENCE_RUNS, write

from quantreg import Key, Method, Registry, audit, settings
from quantreg.host import HostFacts, simulate
from quantreg.methods import check_method, host_shortfall

pytestmark = pytest.mark.usefixtures("clean_env")

GPT_OSS_CPU = Key("gpt_oss_mxfp4", "gpt_oss", "cpu")

CHAIN_TABLE = """
    version: 1
    allow_import_targets: true
    methods:
      needs_qrt_flag:
        target: "qrt_never_imported:Method"
        devices: cpu
        host: [cpu:avx2, cpu:qrt_flag]
    rules:
      - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}
        method: [vllm, needs_qrt_flag, mxfp4_reference]
"""


def registry_on(kind: str, table: Path, monkeypatch: pytest.MonkeyPatch, extra: str = "") -> Registry:
    env = simulate(kind)
    if extra:
        env[settings.HOST_CPU_FLAGS] += "," + extra
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return Registry.build(config=[table])


@pytest.mark.plugin1  # the table names plugin #1's mxfp4_reference (skip contract: skipped without it)
def test_without_amx_vllm_and_a_method_missing_a_flag_are_passed_over(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    table = write(tmp_path / "user.yaml", CHAIN_TABLE)
    registry = registry_on("avx2", table, monkeypatch)
    assert not registry.faults, registry.faults
    decision = registry.resolve(GPT_OSS_CPU)
    assert decision.method == REFERENCE and (decision.fallback is None) == REFERENCE_RUNS
    vllm, needs, ref = decision.chain
    assert not vllm.available and vllm.reason.startswith("vLLM's own method cannot run here: ")
    assert "needs an x86 CPU with AMX" in vllm.reason
    assert not needs.available
    assert needs.reason.startswith("needs cpu flag qrt_flag, this host has an avx2 CPU (flags: avx2, fma)")
    assert needs.reason.endswith(f"flags simulated by {settings.HOST_CPU_FLAGS}")
    assert ref.available == REFERENCE_RUNS
    assert [s.method for s in decision.passed_over] == ["vllm", "needs_qrt_flag"] + (
        [] if REFERENCE_RUNS else ["mxfp4_reference"])
    text = decision.render()
    assert "  no  vllm: passed over: vLLM's own method cannot run here: " in text
    assert "  no  needs_qrt_flag: passed over: needs cpu flag qrt_flag" in text
    assert "host     avx2 (avx2, fma) [simulated]" in text
    assert decision.host is not None and decision.host["kind"] == "avx2"
    assert decision.to_json()["host"]["simulated"] is True


@pytest.mark.plugin1  # the table names plugin #1's mxfp4_reference (skip contract: skipped without it)
def test_with_amx_vllm_stays_chosen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = write(tmp_path / "user.yaml", CHAIN_TABLE)
    decision = registry_on("amx", table, monkeypatch).resolve(GPT_OSS_CPU)
    assert decision.method == "vllm" and decision.keeps_vllm and not decision.passed_over
    assert decision.chain[0].available and decision.chain[0].reason == "vLLM's own method"
    assert decision.chain[1].reason == "not tried: 'vllm' came first"


@pytest.mark.plugin1  # the table names plugin #1's mxfp4_reference (skip contract: skipped without it)
def test_a_met_host_requirement_lets_the_method_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the flag present (and no AMX), the declared method is chosen before the reference."""
    table = write(tmp_path / "user.yaml", CHAIN_TABLE)
    decision = registry_on("avx2", table, monkeypatch, extra="+qrt_flag").resolve(GPT_OSS_CPU)
    assert decision.method == "needs_qrt_flag"
    assert [s.method for s in decision.passed_over] == ["vllm"]


def test_other_keys_keep_vllm_without_amx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No limitation holds for a bf16 key: vLLM's own method stays available on every host."""
    table = write(tmp_path / "user.yaml", """
        version: 1
        rules:
          - {match: {device: cpu}, method: [vllm, mxfp4_reference]}
    """)
    decision = registry_on("avx2", table, monkeypatch).resolve(Key("unquantized", "gpt_oss", "cpu"))
    assert decision.method == "vllm" and decision.chain[0].available


def test_nothing_runs_falls_back_and_says_vllm_will_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = write(tmp_path / "user.yaml", """
        version: 1
        rules:
          - {match: {device: cpu}, method: [vllm, hpu_mxfp4]}
    """)
    decision = registry_on("avx2", table, monkeypatch).resolve(GPT_OSS_CPU)
    assert decision.method == "vllm" and decision.fallback is not None
    # vllm is in this chain, so its refusal is said once, by its chain step (issue 33: each reason once)
    assert decision.fallback == "no method in the chain is available here; vLLM keeps its own method"
    vllm_step = decision.chain[0]
    assert vllm_step.method == "vllm" and not vllm_step.available
    assert vllm_step.reason.startswith("vLLM's own method cannot run here: ")


def test_audit_line_records_the_host_facts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = write(tmp_path / "user.yaml", CHAIN_TABLE)
    decision = registry_on("avx2", table, monkeypatch).resolve(GPT_OSS_CPU)
    line = json.loads(audit.line_for(decision, role="test", layer_count=1, strict=False, fingerprint="f"))
    assert list(line) == list(audit.FIELDS)
    assert line["host"]["kind"] == "avx2" and line["host"]["simulated"] is True
    assert "avx512f" not in line["host"]["flags"] and "avx2" in line["host"]["flags"]


def test_host_shortfall_messages() -> None:
    facts = HostFacts(machine="x86_64", cpu_flags=frozenset({"avx2", "fma"}))
    assert host_shortfall(("cpu:avx2", "cpu:fma"), facts) is None
    assert host_shortfall(("cpu:avx512f", "cpu:avx512bw"), facts) == \
        "needs cpu flags avx512f, avx512bw, this host has an avx2 CPU (flags: avx2, fma)"
    arm = HostFacts(machine="aarch64", cpu_flags=frozenset({"asimd"}))
    assert host_shortfall(("cpu:avx2",), arm) == "needs cpu flag avx2, this host has an aarch64 CPU"


@pytest.mark.parametrize(("flags", "shortfall"), [
    ({"avx2", "fma"}, "needs cpu flag avx512_vnni or avx_vnni, this host has an avx2 CPU (flags: avx2, fma)"),
    ({"avx2", "fma", "avx_vnni"}, None),  # VEX VNNI without AVX-512 (Alder Lake class)
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, None),
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"},  # AVX-512 without VNNI (Skylake-SP)
     "needs cpu flag avx512_vnni or avx_vnni, this host has an avx512 CPU (flags: avx2, avx512bw, avx512f, "
     "avx512vl, fma)"),
])
def test_a_requirement_with_alternatives_is_met_by_either_flag(flags: set[str], shortfall: str | None) -> None:
    """``cpu:A|B``: an int8 kernel needing VNNI in either its EVEX or its VEX form (issue 46, class 3)."""
    facts = HostFacts(machine="x86_64", cpu_flags=frozenset(flags))
    assert host_shortfall(("cpu:avx512_vnni|avx_vnni",), facts) == shortfall
    both = host_shortfall(("cpu:avx2", "cpu:avx512_vnni|avx_vnni", "cpu:amx_tile"), facts)
    assert both is not None and both.startswith("needs cpu flag amx_tile," if shortfall is None else
                                                "needs cpu flags avx512_vnni or avx_vnni, amx_tile,")
    assert check_method(Method(name="m", target="a.b:C", host=("cpu:avx512_vnni|avx_vnni",))) is None


@pytest.mark.parametrize(("host", "expected"), [
    ("cpu:avx2", "host must be a tuple of requirements such as ('cpu:avx2', 'cpu:fma'), got str"),
    (("avx2",), "host holds 'avx2', which is not a requirement of the form 'cpu:FLAG'"),
    (("gpu:avx2",), "host holds 'gpu:avx2'"),
    (("cpu:AVX2",), "host holds 'cpu:AVX2'"),
    ((3,), "host holds 3"),
    (("cpu:avx512_vnni|",), "host holds 'cpu:avx512_vnni|'"),
    (("cpu:|avx_vnni",), "host holds 'cpu:|avx_vnni'"),
    (("cpu:avx2 | fma",), "host holds 'cpu:avx2 | fma'"),
])
def test_registration_type_checks_host(host: object, expected: str) -> None:
    problem = check_method(Method(name="m", target="a.b:C", host=host))  # type: ignore[arg-type]
    assert problem is not None and problem.startswith("method 'm': " + expected), problem
    assert check_method(Method(name="m", target="a.b:C", host=("cpu:avx2", "cpu:fma"))) is None


def test_a_bad_host_in_a_table_method_is_a_located_problem(tmp_path: Path) -> None:
    table = write(tmp_path / "user.yaml", """
        version: 1
        allow_import_targets: true
        methods:
          m:
            target: "qrt_x:Y"
            host: [avx2]
        rules: []
    """)
    registry = Registry.build(config=[table])
    [problem] = [str(p) for p in registry.problems]
    assert f"{table}:6" in problem and "methods.m.host" in problem and "'cpu:FLAG'" in problem, problem


def child(*args: str, kind: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    env.update(simulate(kind))
    return subprocess.run([str(QUANTREG), *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.plugin1  # the table names plugin #1's mxfp4_reference (skip contract: skipped without it)
@pytest.mark.parametrize("kind", ["avx2", "amx"])
def test_explain_in_a_child_on_both_host_kinds(kind: str, tmp_path: Path) -> None:
    table = write(tmp_path / "user.yaml", CHAIN_TABLE)
    out = child("explain", "gpt_oss_mxfp4", "gpt_oss", "cpu", "--config", str(table), "--json", kind=kind)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["host"]["kind"] == kind
    if kind == "avx2":
        assert data["method"] == REFERENCE
        assert data["chain"][0]["reason"].startswith("vLLM's own method cannot run here")
    else:
        assert data["method"] == "vllm" and data["vllm_limitation"] is None
    text = child("explain", "gpt_oss_mxfp4", "gpt_oss", "cpu", "--config", str(table), kind=kind).stdout
    assert ("vllm: passed over: vLLM's own method cannot run here" in text) == (kind == "avx2")


@pytest.mark.plugin1  # the table names plugin #1's mxfp4_reference (skip contract: skipped without it)
def test_doctor_shows_the_host_and_what_its_chains_pass_over(tmp_path: Path) -> None:
    table = write(tmp_path / "user.yaml", CHAIN_TABLE)
    out = child("doctor", "--config", str(table), "--json", kind="avx2")
    data = json.loads(out.stdout)
    assert data["host"]["kind"] == "avx2" and data["host"]["simulated"] is True
    [entry] = [e for e in data["passed_over"] if e["key"] == str(GPT_OSS_CPU)]
    assert entry["method"] == REFERENCE and entry["rule"] == f"{table}:9"
    assert [s["method"] for s in entry["passed_over"]][:2] == ["vllm", "needs_qrt_flag"]
    text = child("doctor", "--config", str(table), kind="avx2").stdout
    flags = settings.HOST_CPU_FLAGS
    assert f"host:      avx2 CPU, {os.cpu_count()} cores, flags avx2, fma (simulated by {flags})" in text
    assert f"chain:     {GPT_OSS_CPU} -> {REFERENCE} [{table}:9]" in text
    assert "  needs_qrt_flag: passed over: needs cpu flag qrt_flag" in text


@pytest.mark.plugin1  # the table names plugin #1's mxfp4_reference (skip contract: skipped without it)
def test_plan_warns_which_chain_entries_this_host_passes_over(tmp_path: Path) -> None:
    from quantreg.models.gpt_oss import tiny_gpt_oss_config

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_gpt_oss_config()))
    table = write(tmp_path / "user.yaml", CHAIN_TABLE)
    out = child("plan", str(model), "--device", "cpu", "--no-vllm", "--json", "--config", str(table), kind="avx2")
    cpu = json.loads(out.stdout)["devices"]["cpu"]
    assert cpu["method"] == REFERENCE
    [warning] = [w for w in cpu["warnings"] if w.startswith("chain: ")]
    assert warning.startswith("chain: vllm: passed over: vLLM's own method cannot run here: ")
    assert "; needs_qrt_flag: passed over: needs cpu flag qrt_flag" in warning


def test_the_json_schema_accepts_a_table_method_with_host_requirements(tmp_path: Path) -> None:
    import jsonschema
    import yaml

    from quantreg.table.schema import table_schema

    doc = yaml.safe_load(CHAIN_TABLE.replace("\n    ", "\n"))
    jsonschema.validate(doc, table_schema())
    doc["methods"]["needs_qrt_flag"]["host"] = ["avx2"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, table_schema())
