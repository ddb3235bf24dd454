"""The ``quantreg`` command: every subcommand with and without ``--json``, ``--config``, QUANTREG_CONFIG.

Most tests call :func:`quantreg.cli.main` in-process (fast); a few run the real console script.
``doctor`` (which imports vLLM to ask for the device) is in test_doctor.py; what the CLI says when a
plugin misbehaves or strict mode refuses is in test_cli_containment.py. Fixtures: cli_support.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_support import Run, cli_json, no_installed_plugins  # noqa: F401 (no_installed_plugins: autouse, keeps the venv's plugins out)
from core_support import (
    HOST_KINDS,
    QUANTREG_VARS,
    HostKind,
    PluginSite,
    run_cli,
)

from quantreg.builtin import default_table_path
from quantreg.cli import main
from quantreg.table.schema import table_schema


# -- list ----------------------------------------------------------------------------------
def test_list(cli: Run) -> None:
    code, out, _ = cli("list", "--device", "hpu")
    assert code == 0
    assert out.splitlines()[0] == "methods available on hpu:"
    assert "yes vllm  quantreg.builtin  quantreg.builtin:KeepVllm  devices=*  (vLLM's own method)" in out
    data = cli_json(cli, "list", "--device", "hpu")
    assert data["problems"] == [] and data["vllm_would_refuse"] is None  # every --json answer says (issue 12)
    rows = data["methods"]
    assert rows == [{"name": "vllm", "plugin": "quantreg.builtin", "target": "quantreg.builtin:KeepVllm",
                     "devices": ["*"], "device": "hpu", "available": True, "reason": "vLLM's own method",
                     "description": "keep the method vLLM itself would build"}]
    # without --device the device is guessed without importing vLLM
    rows = cli_json(cli, "list")["methods"]
    assert rows[0]["device"] in {"cpu", "cuda", "hpu"}


# -- plugins -------------------------------------------------------------------------------
def test_plugins(cli: Run) -> None:
    code, out, _ = cli("plugins")
    assert code == 0
    assert out.splitlines()[0] == "plugins:"
    assert "builtin  quantreg.builtin  (quantreg " in out
    data = cli_json(cli, "plugins")
    assert data["faults"] == []
    assert data["plugins"][0]["name"] == "quantreg.builtin" and data["plugins"][0]["status"] == "builtin"
    assert all(p["status"] in {"builtin", "disabled"} for p in data["plugins"])


# -- rules ---------------------------------------------------------------------------------
def test_rules_with_repeated_config_and_quantreg_config(cli: Run, tables: dict[str, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTREG_CONFIG", str(tables["user"]))
    args = ("rules", "--config", str(tables["run1"]), "--config", str(tables["run2"]))
    rules = cli_json(cli, *args)["rules"]
    assert [(r["path"], r["line"], r["tier"]) for r in rules] == [
        (str(tables["run2"]), 3, "run"),  # specificity 2, priority 5
        (str(tables["run1"]), 3, "run"),  # specificity 2, priority 0
        (str(tables["user"]), 3, "user"),
        (str(default_table_path()), 5, "default"),  # the installed package's copy (site-packages in CI)
    ]
    assert rules[1]["options"] == {"chunk": 2} and rules[1]["match"]["device"] == ["cpu"]
    code, out, err = cli(*args)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "effective rules, highest precedence first:"
    assert lines[1].startswith(f"  {tables['run2']}:3  [run tier, specificity 2, priority 5]  (*, llama, cpu) -> vllm")
    assert lines[2].endswith("options={'chunk': 2}")
    assert lines[3].startswith(f"  {tables['user']}:3  [user tier, specificity 1, priority 0]  (fp8, *, *) -> vllm")


# -- explain -------------------------------------------------------------------------------
def test_explain_shows_winner_and_losers(cli: Run, tables: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTREG_CONFIG", str(tables["user"]))
    args = ("explain", "fp8", "llama", "cpu", "--config", str(tables["run1"]), "--config", str(tables["run2"]))
    code, out, _ = cli(*args)
    assert code == 0
    assert "key      (fp8, llama, cpu)" in out
    assert "method   vllm" in out
    assert f"rule     {tables['run2']}:3 (run tier) match (*, llama, cpu)" in out
    assert f"WON  {tables['run2']}:3 [run tier, specificity 2, priority 5]" in out
    assert (f"lost {tables['run1']}:3 [run tier, specificity 2, priority 0] (fp8, *, cpu) -> vllm: lower priority "
            "(0 < 5)") in out
    assert (f"lost {tables['user']}:3 [user tier, specificity 1, priority 0] (fp8, *, *) -> vllm: lower tier "
            "(user < run)") in out
    assert ("registry.yaml:5 [default tier, specificity 0, priority 0] (*, *, *) -> vllm: lower tier "
            "(default < run)") in out
    data = cli_json(cli, *args)
    assert data["rule"]["path"] == str(tables["run2"]) and data["rule"]["line"] == 3
    assert [(c["rule"]["path"], c["won"], c["reason"]) for c in data["candidates"]][:3] == [
        (str(tables["run2"]), True, "highest precedence (tier, then specificity, then priority)"),
        (str(tables["run1"]), False, "lower priority (0 < 5)"),
        (str(tables["user"]), False, "lower tier (user < run)"),
    ]
    assert data["chain"] == [{"method": "vllm", "available": True, "reason": "vLLM's own method",
                              "plugin": "quantreg.builtin"}]


def test_explain_honours_quantreg_config(cli: Run, tables: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTREG_CONFIG", os.pathsep.join([str(tables["run2"]), str(tables["user"])]))
    data = cli_json(cli, "explain", "fp8", "qwen", "hpu")
    assert data["rule"]["path"] == str(tables["user"]) and data["rule"]["tier"] == "user"
    assert data["rule"]["note"] == "from the user file"


def test_explain_warns_about_faults_on_stderr(cli: Run, table: Callable[[str, str], Path]) -> None:
    bad = table("bad.yaml", "version: 1\nrules:\n  - {match: {}, method: vlm}\n")
    code, out, err = cli("explain", "fp8", "llama", "cpu", "--config", str(bad))
    assert code == 0
    assert f"warning: {bad}:3: rules[0].method: unknown method 'vlm'; did you mean 'vllm'?" in err
    assert "rule     " in out and "(default tier)" in out  # the broken file contributed nothing


@pytest.mark.parametrize("kind", HOST_KINDS)
def test_explain_says_when_vllms_own_method_cannot_run_here(cli: Run, kind: str, host_kind: HostKind,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in fact depends on the host's CPU: the note appears exactly on a host without AMX.

    Both kinds on any host: quantreg is made to believe ``kind`` (``quantreg.host.simulate``).
    """
    for name, value in host_kind.believe(kind).items():
        monkeypatch.setenv(name, value)
    data = cli_json(cli, "explain", "gpt_oss_mxfp4", "gpt_oss", "cpu")
    code, out, _ = cli("explain", "gpt_oss_mxfp4", "gpt_oss", "cpu")
    assert code == 0 and data["method"] == "vllm"
    if not host_kind.kernel_runs(kind):
        assert data["vllm_limitation"].startswith("vLLM's own method will fail for this key here: vLLM 0.32's only "
                                                  "CPU MXFP4 MoE kernel (CPUExpertsMxfp4) needs an x86 CPU with AMX")
        # the reason once (in the chain), then one warning naming the rule and what would serve the key
        assert out.count("needs an x86 CPU with AMX") == 1, out
        last = out.rstrip("\n").splitlines()[-1]
        assert last.startswith("warning  vLLM's own method will fail for this key here (rule "), last
        assert "leaves it to vLLM; why: the chain above). " in last
        assert ("Installed here: '" in last) or ("No installed quantreg method serves it here" in last), last
    else:
        assert data["vllm_limitation"] is None and "will fail for this key" not in out
    assert cli_json(cli, "explain", "fp8", "llama", "cpu")["vllm_limitation"] is None


def test_explain_shows_a_plugins_vllm_limitation_only_for_vllm_decisions(
        cli: Run, plugin_site: PluginSite, table: Callable[[str, str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    plugin_site.add("qrt-npuvendor", {"npuvendor": "qrt_npuvendor"}, modules={"qrt_npuvendor": """
import quantreg
from quantreg.vllm_limits import VllmLimitation


class NpuMethod:
    def __init__(self, moe_config):
        self.moe_config = moe_config


@quantreg.hookimpl
def register_methods(register):
    register(quantreg.Method(name="npu_fp8", target="qrt_npuvendor:NpuMethod", devices=("npu",)))


@quantreg.hookimpl
def register_vllm_limitations(register):
    register(VllmLimitation("the NPU runtime has no fp8 MoE kernel", quant_format="fp8", device="npu",
                            source="npu_runtime/moe.py:7"))
"""})
    monkeypatch.setenv("QUANTREG_PLUGINS", "npuvendor")
    code, out, _ = cli("explain", "fp8", "llama", "npu")
    assert code == 0
    assert out.count("the NPU runtime has no fp8 MoE kernel") == 1, out  # each reason once: in the chain
    assert out.rstrip("\n").splitlines()[-1].startswith(
        "warning  vLLM's own method will fail for this key here (rule "), out
    assert "; why: the chain above). Installed here: 'npumethod' serves it" in out or \
        "No installed quantreg method serves it here" in out, out
    assert cli_json(cli, "explain", "fp8", "llama", "cpu")["vllm_limitation"] is None  # the pattern names npu
    route = table("route.yaml", "version: 1\nrules:\n  - {match: {quant_format: fp8, device: npu}, method: npu_fp8}\n")
    data = cli_json(cli, "explain", "fp8", "llama", "npu", "--config", str(route))
    assert data["method"] == "npu_fp8" and data["vllm_limitation"] is None


# -- validate ------------------------------------------------------------------------------
def test_validate_the_effective_stack(cli: Run, tables: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTREG_CONFIG", str(tables["user"]))
    code, out, _ = cli("validate", "--config", str(tables["run1"]))
    assert (code, out.strip()) == (0, "ok: 3 table(s) valid")
    data = cli_json(cli, "validate", "--config", str(tables["run1"]))
    assert data["ok"] is True and data["problems"] == []
    assert data["files"][1:] == [str(tables["user"]), str(tables["run1"])]


def test_validate_the_effective_stack_with_a_broken_user_file(cli: Run, table: Callable[[str, str], Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    bad = table("bad.yaml", "version: 1\nrules:\n  - {match: {devcie: cpu}, method: vllm}\n")
    monkeypatch.setenv("QUANTREG_CONFIG", str(bad))
    code, out, _ = cli("validate")
    assert code == 1
    assert out.strip().startswith(f"{bad}:3: rules[0].match.devcie: unknown key; did you mean 'device'?")
    code, out, _ = cli("validate", "--json")
    assert code == 1 and json.loads(out)["ok"] is False


def test_validate_files_and_missing_paths(cli: Run, tables: dict[str, Path], tmp_path: Path) -> None:
    code, out, _ = cli("validate", str(tables["user"]), str(tables["run1"]))
    assert (code, out.strip()) == (0, "ok: 2 table(s) valid")
    code, out, _ = cli("validate", str(tmp_path / "nope.yaml"), str(tmp_path))
    assert code == 1
    assert out.splitlines() == [f"{tmp_path / 'nope.yaml'}: no such file",
                                f"{tmp_path}: is a directory; expected a YAML file"]


# -- schema --------------------------------------------------------------------------------
def test_schema(cli: Run) -> None:
    code, out, _ = cli("schema")
    assert code == 0 and json.loads(out) == table_schema()  # the bare schema, for editors
    code, out, _ = cli("schema", "--json")  # like every --json answer: the envelope, the schema under "schema"
    data = json.loads(out)
    assert code == 0 and data["schema"] == table_schema() and data["problems"] == []


# -- plan and tiny-model ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", HOST_KINDS)
def test_tiny_model_then_plan(cli: Run, tmp_path: Path, table: Callable[[str, str], Path], kind: str,
                              host_kind: HostKind, monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator's path without vLLM: write the tiny checkpoint, then ask what each device gets
    (on a host of either kind, as quantreg believes it: the CPU warning appears exactly without AMX)."""
    for name, value in host_kind.believe(kind).items():
        monkeypatch.setenv(name, value)
    model = tmp_path / "tiny"
    code, out, _ = cli("tiny-model", str(model))
    assert code == 0 and f"to {model}" in out and "python -m vllm.entrypoints.openai.api_server" in out
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model / name).is_file(), name
    route = table("route.yaml", "version: 1\nrules:\n  - {match: {quant_format: gpt_oss_mxfp4, device: hpu}, "
                                "method: vllm, priority: 3}\n")
    data = cli_json(cli, "plan", str(model), "--device", "cpu", "--device", "hpu", "--no-vllm",
                    "--config", str(route))
    assert data["key"] == {"quant_format": "gpt_oss_mxfp4", "model_type": "gpt_oss"}
    assert data["moe_layers"] == 2 and data["experts"]["count"] == 4
    assert list(data["devices"]) == ["cpu", "hpu"]
    assert data["devices"]["hpu"]["rule"] == f"{route}:3"
    assert data["devices"]["cpu"]["rule"].endswith("registry.yaml:5")
    for device in ("cpu", "hpu"):
        assert set(data["devices"][device]) >= {"method", "rule", "expert_bytes", "warnings"}
        assert data["devices"][device]["method"] == "vllm" and data["devices"][device]["expert_bytes"] > 0
    cpu_warned = any("vLLM's own method will fail" in w for w in data["devices"]["cpu"]["warnings"])
    assert cpu_warned == (not host_kind.kernel_runs(kind))
    code, out, _ = cli("plan", str(model), "--device", "cpu", "--no-vllm")
    assert code == 0 and out.startswith(f"model     {model}\nkey       (gpt_oss_mxfp4, gpt_oss, <device>)")


def test_plan_of_a_directory_without_config_is_a_located_problem(cli: Run, tmp_path: Path) -> None:
    code, out, _ = cli("plan", str(tmp_path), "--device", "cpu", "--no-vllm", "--json")
    assert code == 1
    data = json.loads(out)
    assert f"{tmp_path / 'config.json'}: missing" in " ".join(p["text"] for p in data["problems"])
    assert data["problems"][0]["path"] == str(tmp_path / "config.json")
    assert data["left_out"] == [] and data["vllm_would_refuse"] is None  # the documented envelope
    code, out, _ = cli("plan", str(tmp_path), "--device", "cpu", "--no-vllm")
    assert code == 1 and out.startswith("problem   ") and "MoE layer(s)" not in out  # only its error


# -- the console script and argument errors ---------------------------------------------------
def test_console_script_and_python_m(tables: dict[str, Path]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in QUANTREG_VARS}
    env.update(QUANTREG_PLUGINS="", QUANTREG_CONFIG=str(tables["user"]))
    out = run_cli("explain", "fp8", "llama", "hpu", env=env)
    assert out.returncode == 0, out.stderr
    assert f"rule     {tables['user']}:3 (user tier)" in out.stdout
    out = subprocess.run([sys.executable, "-m", "quantreg", "explain", "fp8", "llama", "hpu", "--json"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["rule"]["path"] == str(tables["user"])


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["explain", "fp8"], ["list", "--device"]])
def test_usage_errors_exit_2_without_traceback(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: quantreg") and "Traceback" not in err


# -- CLI edges (issue 22 classes 4 and 7) ---------------------------------------------------------
def test_version_and_a_top_level_help_in_whole_sentences(capsys: pytest.CaptureFixture[str]) -> None:
    from quantreg import installed

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    version = f"quantreg {installed.dist_version('quantreg')}"
    assert info.value.code == 0 and capsys.readouterr().out.strip() == version
    with pytest.raises(SystemExit):
        main(["--help"])
    head = capsys.readouterr().out.split("positional arguments")[0]
    description = " ".join(head.split("\n\n", 1)[1].split())
    assert description.endswith(".") and "``" not in head and ":func:" not in head, head


def test_explain_help_names_its_positionals_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    out = capsys.readouterr().out
    for fragment in ("quant_format", "vLLM's quant format name", "model_type", "device", "vLLM's device type",
                     "quantreg explain gpt_oss_mxfp4 gpt_oss cpu", "quantreg plan MODEL_DIR"):
        assert fragment in out, fragment


@pytest.mark.parametrize("command", [["list"], ["plugins"], ["rules"], ["explain", "fp8", "llama", "cpu"],
                                     ["validate"], ["doctor"], ["plan", "."], ["check-method", "vllm"]])
def test_a_named_missing_config_is_an_error_for_every_command(command: list[str], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.yaml"
    assert main([*command, "--config", str(missing)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"quantreg: error: --config {missing}: no such file\n"


@pytest.mark.parametrize("command", [["schema"], ["tiny-model", "somewhere"], ["demo"]])
def test_config_is_offered_only_where_tables_matter(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([*command, "--config", "t.yaml"])
    assert info.value.code == 2 and "unrecognized arguments: --config" in capsys.readouterr().err
