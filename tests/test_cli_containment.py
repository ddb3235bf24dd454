"""The CLI says what start-up will do, from test_containment_plugins.py (issue 12, plugin and start-up
classes; issue 24 class 5): class 9, a plugin calling sys.exit cannot end the CLI; strict mode answers
and says vLLM would refuse, lenient mode shows the left-out file inline; stdout stays JSON when a
plugin prints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_support import no_installed_plugins  # noqa: F401 (autouse: keeps the venv's plugins out)
from core_support import (
    IMPORT_FAULTS,
    PRINTER,
    PluginSite,
    add,
    run_quantreg,
    write,
)

# -- from test_containment_plugins.py (issue 12, plugin and start-up classes) -----------------


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("args", [["validate", "BROKEN"], ["validate"], ["list", "--json"],
                                  ["explain", "a", "b", "cpu"]])
def test_a_plugin_calling_sys_exit_cannot_end_the_cli(plugin_site: PluginSite, tmp_path: Path,
                                                      args: list[str]) -> None:
    add(plugin_site, "quitter", IMPORT_FAULTS["exit0"][0])
    broken = write(tmp_path / "broken.yaml", "version: 1\nrules: 5\n")
    args = [str(broken) if a == "BROKEN" else a for a in args]
    out = run_quantreg(*args, site=plugin_site, plugins="quitter")
    assert "Traceback" not in out.stderr
    if args[0] == "validate":
        assert out.returncode == 1, out.stdout + out.stderr  # the table (or the plugin) is broken: never 0
        assert (str(broken) if len(args) > 1 else "plugin 'quitter'") in out.stdout
    else:
        assert out.returncode == 0, out.stderr
        assert "plugin 'quitter'" in out.stderr
    if "--json" in args:
        assert any("plugin 'quitter'" in p["text"] for p in json.loads(out.stdout)["problems"])


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("args", [["list"], ["rules"], ["explain", "fp8", "llama", "cpu"], ["plugins"]])
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_strict_cli_answers_and_says_vllm_would_refuse(broken_user: Path, args: list[str],
                                                       json_flag: list[str]) -> None:
    out = run_quantreg(*args, *json_flag, QUANTREG_CONFIG=str(broken_user), QUANTREG_STRICT="1")
    assert out.returncode == 1, out.stdout + out.stderr
    [refusal] = [line for line in out.stderr.splitlines() if line.startswith("vLLM would refuse to start")]
    assert refusal == (f"vLLM would refuse to start (QUANTREG_STRICT=1): {broken_user}:3: rules[0].method: "
                       "unknown method 'nope' (registered: vllm)")
    if json_flag:
        data = json.loads(out.stdout)
        assert data["vllm_would_refuse"] == refusal
        assert [p["text"] for p in data["problems"]] == [refusal.split("): ", 1)[1]]
    else:
        assert out.stdout.strip()  # the rest is still printed


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("args", [["list"], ["rules"], ["explain", "fp8", "llama", "cpu"], ["plugins"]])
def test_lenient_cli_shows_the_left_out_file_inline(broken_user: Path, args: list[str]) -> None:
    out = run_quantreg(*args, QUANTREG_CONFIG=str(broken_user))
    assert out.returncode == 0, out.stderr
    assert f"  user    {broken_user} LEFT OUT: 1 problem" in out.stdout.splitlines()
    data = json.loads(run_quantreg(*args, "--json", QUANTREG_CONFIG=str(broken_user)).stdout)
    assert data["left_out"] == [{"path": str(broken_user), "tier": "user", "layer": "user", "problems": 1}]
    assert data["vllm_would_refuse"] is None and len(data["problems"]) == 1


@pytest.mark.usefixtures("clean_env")
def test_a_strict_chain_with_nothing_available_refuses_in_explain(tmp_path: Path) -> None:
    table = write(tmp_path / "t.yaml", """
        version: 1
        strict: true
        allow_import_targets: true
        methods:
          hpu_only: {target: "qrt_x:Y", devices: hpu}
        rules:
          - {match: {device: cpu}, method: hpu_only}
    """)
    out = run_quantreg("explain", "fp8", "llama", "cpu", QUANTREG_CONFIG=str(table))
    assert out.returncode == 1, out.stderr
    [refusal] = [line for line in out.stderr.splitlines() if line.startswith("vLLM would refuse")]
    assert refusal.startswith(f"vLLM would refuse to start (strict: true in {table}): ")
    assert refusal.endswith("(at the first layer with this key)")
    assert run_quantreg("explain", "fp8", "llama", "hpu", QUANTREG_CONFIG=str(table)).returncode == 0


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("args", [["list", "--device", "cpu"], ["rules"], ["plugins"], ["validate"],
                                  ["explain", "fp8", "llama", "cpu"]])
def test_stdout_stays_json_when_a_plugin_prints(plugin_site: PluginSite, args: list[str]) -> None:
    add(plugin_site, "printer", PRINTER)
    out = run_quantreg(*args, "--json", site=plugin_site, plugins="printer")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["problems"] == []
    assert "hello from import" in out.stderr and "hello from the hook" in out.stderr
    if args[0] == "list":
        assert "hello from the probe" in out.stderr
