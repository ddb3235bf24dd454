"""The plugin as installed: its entry point, the method's declarations, its probe, options and table."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from quantreg_cpu_mxfp4 import options, plugin, probe

import quantreg
from quantreg.host import simulate
from quantreg.testing.packaging import installed_entry_point

KEY = ("gpt_oss_mxfp4", "gpt_oss", "cpu")
MIXTRAL_KEY = ("mxfp4", "mixtral", "cpu")


def test_entry_point_is_installed() -> None:
    installed_entry_point("cpu_mxfp4", plugin, "quantreg-cpu-mxfp4")  # the kit: one, of this dist, loads plugin


def test_registering_and_resolving_import_neither_torch_nor_vllm() -> None:
    code = ("import sys, quantreg; r = quantreg.Registry.build(env={}); m = r.methods['cpu_mxfp4']; "
            f"r.resolve({KEY!r}); r.resolve({MIXTRAL_KEY!r}); "
            "bad = {'torch', 'vllm', 'quantreg_cpu_mxfp4.kernel'} & set(sys.modules); assert not bad, bad; "
            "print(m.devices, m.requires, m.options)")
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert done.stdout.strip() == "('cpu',) ('torch', 'vllm') ('alpha', 'limit', 'routing', 'precision')"


def test_options_have_one_field_each_and_are_checked() -> None:
    assert options.FIELDS == plugin.OPTIONS
    assert options.MethodOptions.parse("cpu_mxfp4", {}) == options.MethodOptions()
    with pytest.raises(TypeError, match=r"unknown option\(s\) 'alpah'; accepted: alpha, limit, routing, precision"):
        options.MethodOptions.parse("cpu_mxfp4", {"alpah": 1.0})
    with pytest.raises(ValueError, match=r"routing='grouped' is not one of auto, topk_softmax, softmax_topk, vllm"):
        options.MethodOptions.parse("cpu_mxfp4", {"routing": "grouped"})
    with pytest.raises(ValueError, match=r"limit=-1 must be a positive finite number"):
        options.MethodOptions.parse("cpu_mxfp4", {"limit": -1})
    assert options.MethodOptions.parse("cpu_mxfp4", {"precision": "q8"}).precision == "q8"
    assert options.MethodOptions.parse("cpu_mxfp4", {}).precision == ""  # the process default
    with pytest.raises(ValueError, match=r"precision='q4' is not one of q8x2, q8"):
        options.MethodOptions.parse("cpu_mxfp4", {"precision": "q4"})


def test_probe_agrees_with_the_kernel_status() -> None:
    """The probe loads the library (no torch) and names the ISA path; the kernel's status uses the same
    loader: they agree, on the ISA path too."""
    ok, why = probe.kernel_available()
    from quantreg_cpu_mxfp4 import kernel

    status = kernel.status()
    assert ok is status[0] and (why.startswith("kernel loaded: libquantreg_cpu_mxfp4.so (ABI 3), ISA path ") if ok
                                else "not built" in why)
    if ok:
        assert why.split("ISA path ")[1].split()[0] == status[1], (why, status)


def test_probe_says_unavailable_when_the_extension_is_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """No library file in the package (what an install without a compiler leaves)."""
    monkeypatch.setattr(probe, "LIBRARY", Path("/nonexistent/libquantreg_cpu_mxfp4.so"))
    ok, why = probe.kernel_available()
    assert not ok and why.startswith("unavailable: extension not built (")


def test_a_chain_moves_on_when_the_kernel_is_unavailable(tmp_path: Path) -> None:
    """Through the real registry and the installed entry points, in a process whose kernel cannot import."""
    table = tmp_path / "chain.yaml"
    table.write_text("version: 1\nrules:\n  - match: {quant_format: gpt_oss_mxfp4, device: cpu}\n"
                     "    method: [cpu_mxfp4, mxfp4_reference]\n")
    code = ("import pathlib, quantreg_cpu_mxfp4.probe as p; "
            "p.LIBRARY = pathlib.Path('/nonexistent/libquantreg_cpu_mxfp4.so'); import quantreg; "
            f"d = quantreg.Registry.build(config=[{str(table)!r}], env={{}}).resolve({KEY!r}); "
            "print(d.method); print(d.chain[0].reason)")
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    method, reason = done.stdout.strip().splitlines()
    assert method == "mxfp4_reference" and reason.startswith("unavailable: extension not built")


@pytest.mark.parametrize("key", [KEY, MIXTRAL_KEY])
def test_plugin_table_routes_both_keys_through_vllm_then_cpu_mxfp4(key: tuple[str, str, str]) -> None:
    registry = quantreg.Registry.build(env={})
    assert not registry.problems, registry.problems
    decision = registry.resolve(key)
    assert decision.rule is not None and decision.rule.path == str(plugin.rules_path())
    assert decision.rule.tier == quantreg.Tier.PLUGIN and decision.rule.methods == ("vllm", "cpu_mxfp4")


def _env() -> dict[str, str]:
    """This process's environment without any QUANTREG_ setting: a child sees only the installed tables."""
    return {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}


def _decision(kind: str, **extra: str) -> list[Any]:
    """A fresh interpreter's decision for KEY on a simulated host ``kind``, with ``extra`` in its
    environment: ``[method, the winning rule's options, its path]``. Run from this directory, so the
    child imports the installed quantreg, never the source tree at the repository's root."""
    code = (f"import json, quantreg; d = quantreg.Registry.build().resolve({KEY!r}); "
            "print(json.dumps([d.method, dict(d.rule.options), d.rule.path]))")
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                          env={**_env(), **simulate(kind), **extra}, cwd=Path(__file__).resolve().parent)
    decision: list[Any] = json.loads(done.stdout)
    return decision


def _decide(kind: str) -> str:
    method: str = _decision(kind)[0]
    return method


def test_on_an_amx_host_the_plugin_rule_keeps_vllms_own_kernel() -> None:
    assert _decide("amx") == quantreg.VLLM_METHOD


def test_on_a_host_without_amx_the_plugin_rule_picks_cpu_mxfp4() -> None:
    """Simulated AVX2-only host (both kinds' branch run here): vLLM refuses GPT-OSS MXFP4 there."""
    assert _decide("avx2") == "cpu_mxfp4"


@pytest.mark.parametrize("kind", ["avx2", "amx"])
def test_the_opt_in_q8_table_keeps_the_chain_and_sets_precision_q8(kind: str) -> None:
    """``python -m quantreg_cpu_mxfp4`` prints the packaged q8.yaml; as QUANTREG_CONFIG it decides what the
    plugin's rule decides on every host kind (vLLM's kernel with AMX, cpu_mxfp4 without), and cpu_mxfp4
    gets ``precision: q8``; installed alone the plugin's rule (no options) still decides."""
    env = _env()
    path = subprocess.run([sys.executable, "-m", "quantreg_cpu_mxfp4"], check=True, capture_output=True,
                          text=True, env=env).stdout.strip()
    assert path == str(plugin.q8_table_path()) and Path(path).is_file()
    runs = {"q8": _decision(kind, QUANTREG_CONFIG=path), "plain": _decision(kind)}
    assert runs["q8"][0] == runs["plain"][0] == (quantreg.VLLM_METHOD if kind == "amx" else "cpu_mxfp4")
    assert runs["q8"][1:] == [{"precision": "q8"}, path]
    assert runs["plain"][1:] == [{}, str(plugin.rules_path())]
    validated = subprocess.run([sys.executable, "-m", "quantreg", "validate", path], capture_output=True, text=True,
                               env=env)
    assert validated.returncode == 0 and "ok: 1 table(s) valid" in validated.stdout, validated.stdout + validated.stderr


def test_readme_opt_in_command_runs_as_written() -> None:
    """plugins/cpu_mxfp4/README.md's one ``$`` command, run by bash as written: without AMX (real or
    simulated) the q8 table's rule wins with ``precision: q8`` and cpu_mxfp4 serves; with AMX (simulated)
    vLLM's own method keeps the key."""
    readme = Path(__file__).resolve().parent.parent / "README.md"
    commands = re.findall(r"^\$ (.+)$", readme.read_text(), re.MULTILINE)
    assert commands == ["QUANTREG_CONFIG=$(python -m quantreg_cpu_mxfp4) quantreg explain gpt_oss_mxfp4 gpt_oss cpu"]
    env = _env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for kind in ("avx2", "amx"):
        done = subprocess.run(["bash", "-c", commands[0]], capture_output=True, text=True, timeout=300,
                              env={**env, **simulate(kind)})
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[1] == f"method   {'vllm' if kind == 'amx' else 'cpu_mxfp4'}", done.stdout
        assert lines[2].startswith("rule     ") and "q8.yaml:" in lines[2], done.stdout
        assert "options  {'precision': 'q8'}" in lines, done.stdout


def test_plan_counts_the_packed_expert_bytes_it_keeps(tmp_path: Path) -> None:
    """The method keeps experts packed (PackedExperts shares vLLM's storage), so it declares
    ``expert_layout="packed"``: before, ``quantreg plan`` said "expert_bytes unknown" where it chose it."""
    from quantreg.models.gpt_oss import tiny_gpt_oss_config

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_gpt_oss_config()))
    env = _env()
    code = ("import json, quantreg; from quantreg.plan import plan; r = quantreg.Registry.build(); "
            f"print(json.dumps(plan({str(model)!r}, ['cpu'], r, use_vllm=False)))")
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                          env={**env, **simulate("avx2")})  # a host where the plugin's chain reaches cpu_mxfp4
    data = json.loads(done.stdout)
    cpu = data["devices"]["cpu"]
    assert cpu["method"] == "cpu_mxfp4"
    assert cpu["expert_bytes"] == data["experts"]["bytes_per_layer"]["packed"] * data["moe_layers"] > 0
    assert not [w for w in cpu["warnings"] if "expert_layout" in w], cpu["warnings"]
    assert quantreg.Registry.build(env={}).methods["cpu_mxfp4"].expert_layout == "packed"


@pytest.mark.parametrize("option", sorted(plugin.OPTION_VALUES))
def test_validate_refuses_every_option_value_the_registration_declares_it_cannot_take(
        tmp_path: Path, option: str) -> None:
    """Issue 53, class 2: the registration declares each fixed set of values (``option_values``), and the
    real ``quantreg validate`` refuses any other at FILE:LINE and key, before a start-up builds the method.
    The declaration and the constructor's own check agree on every declared value and on the refused one."""
    accepted = plugin.OPTION_VALUES[option]
    for value in accepted:  # the constructor takes every declared value
        options.MethodOptions.parse("cpu_mxfp4", {option: value})
    with pytest.raises(ValueError, match=rf"{option}='q4' is not one of"):
        options.MethodOptions.parse("cpu_mxfp4", {option: "q4"})
    for value, ok in ((accepted[-1], True), ("q4", False)):
        table = tmp_path / f"{option}-{value}.yaml"
        table.write_text("version: 1\nrules:\n  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss}\n"
                         f"    method: cpu_mxfp4\n    options: {{{option}: {value}}}\n", encoding="utf-8")
        done = subprocess.run([sys.executable, "-m", "quantreg", "validate", str(table)], capture_output=True,
                              text=True, timeout=120)
        assert (done.returncode == 0) is ok, done.stdout + done.stderr
        if not ok:
            shown = ", ".join(repr(v) for v in accepted)
            assert done.stdout.strip() == (f"{table}:5: rules[0].options.{option}: method 'cpu_mxfp4' does not accept "
                                           f"option {option}='q4' (accepted: {shown})"), done.stdout
            assert "Traceback" not in done.stderr


def test_explain_names_the_method_that_serves_when_a_declared_value_is_refused(tmp_path: Path) -> None:
    """The object a start-up hands vLLM is the one ``explain`` names (issue 53, class 4): the winning rule's
    ``cpu_mxfp4`` cannot be built with ``precision: q4``, so explain says the layer goes to the next
    rule's ``mxfp4_reference``, as the seams' walk does (tests/e2e/test_seams_round6.py serves it)."""
    table = tmp_path / "refused.yaml"
    table.write_text("version: 1\nrules:\n  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}\n"
                     "    method: cpu_mxfp4\n    options: {precision: q4}\n"
                     "  - match: {quant_format: gpt_oss_mxfp4}\n    method: mxfp4_reference\n", encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "quantreg", "explain", *KEY, "--config", str(table)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert ("warning  method 'cpu_mxfp4' does not accept option precision='q4' (accepted: 'q8x2', 'q8'): it cannot be "
            f"built, and the layer goes to 'mxfp4_reference' [{table}:6], the next method known to run here"
            ) in done.stdout.splitlines(), done.stdout
