"""One computation answers every tool (issue 22.3, 24.1): ``explain``, ``plan``, ``doctor`` and the
start-up decision line say the same about a key on the same host and tables.

The bug this holds shut: ``plan`` re-derived what vllm-gaudi does ("set HPU_MXFP4_NATIVE=1, the
config is dropped") while plugin #1's keeper and its ``doctor`` finding said quantreg keeps it.
The vllm-gaudi double (tests/e2e/vllm_gaudi_double) is on ``sys.path`` so plugin #1 (installed,
found through its real entry point) sees vllm-gaudi as installed and speaks.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from core_support import REFERENCE_RUNS

from quantreg import plan as planmod
from quantreg.answer import answer
from quantreg.cli import main
from quantreg.keys import Key
from quantreg.registry import Registry

DOUBLE = Path(__file__).parent / "e2e" / "vllm_gaudi_double"
KEY = Key("gpt_oss_mxfp4", "gpt_oss", "cpu")

TABLES = {
    "keeps": """
        version: 1
        rules:
          - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}
            method: [hpu_mxfp4, mxfp4_reference]
        """,
    "strips": """
        version: 1
        rules:
          - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}
            method: vllm
            priority: 100
        """,
}

CONFIG = {"model_type": "gpt_oss", "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
          "hidden_size": 64, "intermediate_size": 64, "quantization_config": {"quant_method": "mxfp4"}}


def _plugin_installed() -> bool:
    return any(p.name == "hpu_mxfp4" and p.status == "loaded"
               for p in Registry.build(entry_points=True).plugin_infos)


@pytest.fixture
def gaudi(monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    if not _plugin_installed():
        pytest.skip("plugin #1 (quantreg-hpu-mxfp4) is not installed: its findings are what is compared")
    monkeypatch.syspath_prepend(str(DOUBLE))
    monkeypatch.delenv("HPU_MXFP4_NATIVE", raising=False)


def _startup_line(registry: Registry, caplog: pytest.LogCaptureFixture) -> str:
    from quantreg.vllm.seam import Seam  # the seam's own logging, no vLLM needed to call it

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.quantreg"):
        Seam().run.log_once(registry.resolve(KEY), registry)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"quantreg: {KEY}")]
    return line.removeprefix("quantreg: ")


@pytest.mark.parametrize("case", sorted(TABLES))
def test_explain_plan_and_startup_give_one_answer(case: str, gaudi: None, table: Any, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    path = table(f"{case}.yaml", TABLES[case])
    registry = Registry.build(config=[path])
    truth = answer(registry, KEY)
    mine = [f for f in truth.findings if f.plugin == "hpu_mxfp4"]
    assert len(mine) == 1, truth  # plugin #1 speaks for vllm-gaudi; core says nothing of its own
    if case == "keeps" and REFERENCE_RUNS:  # without torch the reference cannot run: the chain keeps vllm
        assert truth.decision.method == "mxfp4_reference" and mine[0].level == "info"
        assert "quantreg keeps the MXFP4 quant config" in mine[0].message
    else:
        assert truth.decision.method == "vllm" and mine[0].level == "warning"
        assert "vllm-gaudi strips the MXFP4 quant config" in mine[0].message

    assert main(["explain", *KEY, "--config", str(path), "--json"]) == 0
    explained = json.loads(capsys.readouterr().out)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    planned = planmod.plan(model, ["cpu"], Registry.build(config=[path]), use_vllm=False)["devices"]["cpu"]
    started = _startup_line(Registry.build(config=[path]), caplog)

    assert explained["line"] == planned["line"] == started == truth.line()
    assert explained["notes"] == planned["notes"] == list(truth.notes)
    assert explained["findings"] == planned["findings"] == [f.as_json() for f in truth.findings]
    assert not any("HPU_MXFP4_NATIVE=1 to keep" in w for w in planned["warnings"])  # the old core re-derivation


@pytest.mark.vllm  # doctor asks vLLM for the device (imports it, a few seconds)
def test_doctor_reports_the_same_findings(gaudi: None, table: Any) -> None:
    pytest.importorskip("vllm", reason="doctor's device comes from vLLM")
    path = table("strips.yaml", TABLES["strips"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_") and k != "HPU_MXFP4_NATIVE"}
    env["PYTHONPATH"] = os.pathsep.join([str(DOUBLE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run([sys.executable, "-m", "quantreg", "doctor", "--json", "--config", str(path)],
                         capture_output=True, text=True, env=env, timeout=300, cwd=path.parent)
    data = json.loads(out.stdout)
    assert data["device"] == "cpu", out.stderr[-2000:]
    truth = answer(Registry.build(config=[path]), KEY)
    about = [f for f in data["findings"] if f["key"] == list(KEY)]
    assert about == [f.as_json() for f in truth.findings] and about


HOST_CODE = """
import contextlib, io, json, logging, sys
from pathlib import Path
from quantreg import plan as planmod
from quantreg.answer import answer
from quantreg.cli import main
from quantreg.doctor import _passed_over
from quantreg.keys import Key
from quantreg.registry import Registry
from quantreg.vllm.seam import Seam

key = Key("gpt_oss_mxfp4", "gpt_oss", "cpu")
out = io.StringIO()
with contextlib.redirect_stdout(out):
    main(["explain", *key, "--json"])
explained = json.loads(out.getvalue())
planned = planmod.plan(sys.argv[1], ["cpu"], Registry.build(), use_vllm=False)["devices"]["cpu"]
lines = []
handler = logging.Handler()
handler.emit = lambda record: lines.append(record.getMessage())
logger = logging.getLogger("vllm.quantreg")
logger.addHandler(handler)
logger.setLevel(logging.INFO)
registry = Registry.build()
Seam().run.log_once(registry.resolve(key), registry)
started = [m.removeprefix("quantreg: ") for m in lines if m.startswith(f"quantreg: {key}")]
doctor = [e for e in _passed_over(Registry.build()) if e["key"] == str(key)]
truth = answer(Registry.build(), key)
print(json.dumps({"explain": explained["line"], "plan": planned["line"], "started": started,
                  "doctor": doctor, "truth": truth.line(), "method": truth.decision.method,
                  "limitation": explained["vllm_limitation"], "plan_limitation": planned["vllm_limitation"]}))
"""


@pytest.mark.parametrize("kind", ["real", "avx2", "amx"])
def test_every_tool_gives_one_answer_on_each_host_kind(kind: str, tmp_path: Path) -> None:
    """Host-aware chains decide per host: on a simulated AMX host, an AVX2-only one and this one,
    explain, plan, doctor's chain lines and the start-up line still say the same, with the
    installed plugins' tables (the real entry points) and no user table."""
    from quantreg.host import simulate

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    env |= simulate(kind) if kind != "real" else {}
    done = subprocess.run([sys.executable, "-c", HOST_CODE, str(model)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(done.stdout.splitlines()[-1])
    assert data["explain"] == data["plan"] == data["truth"] and data["started"] == [data["truth"]], data
    assert data["limitation"] == data["plan_limitation"]
    for entry in data["doctor"]:  # doctor lists a chain only where this host passes an entry over
        assert entry["method"] == data["method"], data
    if kind == "amx":  # vLLM's own kernel runs: nothing to say against it, whoever else is installed
        assert data["method"] == "vllm" and data["limitation"] is None and data["doctor"] == []
    elif kind == "avx2":  # vLLM refuses MXFP4 here: a rule picks another method, or every tool warns
        assert data["method"] != "vllm" or data["limitation"], data
