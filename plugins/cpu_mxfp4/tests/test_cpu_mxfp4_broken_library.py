"""A library that is there but cannot run is passed over before the method is built (issue 46, class 2;
class 17 of docs/reliability.md).

Before: with ``libquantreg_cpu_mxfp4.so`` of another ABI version, or a file that is not a library,
the probe said "kernel built" (it only looked the file up), ``explain`` chose ``cpu_mxfp4``, the
method built and loaded weights, and the first forward raised -- after the seam's containment, so
vLLM did not start, lenient or not. Now the probe loads the library and checks its ABI version
(:func:`quantreg_cpu_mxfp4.probe.load_library`) and the constructor refuses the same way
(:func:`quantreg_cpu_mxfp4.kernel.require`).

The installed wheel is never touched: each case is a copy of the installed package in a temporary
directory with its library replaced, first on ``PYTHONPATH`` of the processes it runs (quantreg's
CLI, the kit, real vLLM), so the entry point ``quantreg_cpu_mxfp4.plugin`` and the method's
target import the copy. The wrong-ABI library is a real shared object built here with the C
compiler (the same three entry points, ``qr_abi_version()`` returning 1).

Issue 53, class 3: two more libraries of the right ABI whose ELF constructor blocks forever or
calls ``abort()``. Loaded in-process they would hang ``explain`` (``ctypes`` holds the GIL, so the
probe-timeout thread never runs) or kill it; the probe has a child process load them first
(:mod:`quantreg.native`), so ``explain`` answers within the probe timeout plus start-up.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

KEY = ("gpt_oss_mxfp4", "gpt_oss", "cpu")
LIBRARY = "libquantreg_cpu_mxfp4.so"
ABI_VERSION = pytest.importorskip("quantreg_cpu_mxfp4.probe", reason="plugin #2 (plugins/cpu_mxfp4) is not installed"
                                  ).ABI_VERSION
REFERENCE = "quantreg_hpu_mxfp4.method:Mxfp4ReferenceMoEMethod"
WRONG_ABI = r"""
#include <stdint.h>
int32_t qr_abi_version(void) { return 1; }
int32_t qr_cpu_supports(const char* isa) { (void)isa; return 1; }
int32_t qr_moe_forward(const void* args, char* err, int64_t errlen) { (void)args; (void)err; (void)errlen; return 1; }
"""
#: a library of this ABI whose ELF constructor misbehaves at load (issue 53, class 3): %s is the constructor's body
MISBEHAVING = r"""
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((constructor)) static void qr_test_ctor(void) { %s }
int32_t qr_abi_version(void) { return %d; }
int32_t qr_cpu_supports(const char* isa) { (void)isa; return 1; }
int32_t qr_moe_forward(const void* args, char* err, int64_t errlen) { (void)args; (void)err; (void)errlen; return 1; }
"""
PROBE_TIMEOUT = 4.0
"""QUANTREG_PROBE_TIMEOUT of every run here: the blocking library's child is killed at four fifths of it."""
CONSTRUCTORS = {"blocks-at-load": "for (;;) pause();", "aborts-at-load": "abort();"}
#: case -> what the reason must say
CASES = {
    "wrong-abi": f"extension does not load ({LIBRARY} has ABI version 1, this package expects {ABI_VERSION}",
    "not-a-library": f"extension does not load ({LIBRARY} does not load (",
    "blocks-at-load": f"extension does not load ({LIBRARY} did not finish loading within "
                      f"{PROBE_TIMEOUT * 0.8:.1f}s (QUANTREG_PROBE_TIMEOUT {PROBE_TIMEOUT:g}s): "
                      "a constructor that blocks",
    "aborts-at-load": f"extension does not load ({LIBRARY} kills the process that loads it (SIGABRT while loading)",
}


def _installed_package() -> Path:
    spec = importlib.util.find_spec("quantreg_cpu_mxfp4")
    if spec is None or spec.origin is None:
        pytest.skip("quantreg-cpu-mxfp4 is not installed")
    package = Path(spec.origin).parent
    if not (package / LIBRARY).is_file():
        pytest.skip(f"the installed quantreg-cpu-mxfp4 has no {LIBRARY}: nothing to break")
    return package


def broken_copy(root: Path, case: str) -> Path:
    """A directory to put first on ``PYTHONPATH``: the installed package with its library replaced."""
    target = root / case / "quantreg_cpu_mxfp4"
    shutil.copytree(_installed_package(), target, ignore=shutil.ignore_patterns("__pycache__"))
    library = target / LIBRARY
    library.unlink()
    if case in ("wrong-abi", *CONSTRUCTORS):
        source = root / case / "stub.c"
        source.write_text(WRONG_ABI if case == "wrong-abi" else MISBEHAVING % (CONSTRUCTORS[case], ABI_VERSION))
        compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if compiler is None:
            pytest.skip("no C compiler to build a library of another ABI version")
        subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True,
                       capture_output=True, text=True, timeout=120)
    else:
        library.write_text("this is not a shared library\n")
    return target.parent


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cpu-mxfp4-broken")
    return {case: broken_copy(root, case) for case in CASES}


def env_for(copy: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(copy), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**env, "QUANTREG_PROBE_TIMEOUT": str(PROBE_TIMEOUT), **extra}


def chain_table(directory: Path, methods: str) -> Path:
    path = directory / f"chain-{methods.replace(',', '-').replace(' ', '')}.yaml"
    path.write_text("version: 1\nrules:\n  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}\n"
                    f"    method: [{methods}]\n")
    return path


def python(code: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_probe_loads_the_library_and_says_why_it_is_not_usable(case: str, copies: dict[str, Path]) -> None:
    """The copy is the one imported; its probe (no torch) and the kernel's status agree on the reason."""
    code = ("import json, sys, quantreg_cpu_mxfp4.probe as p; probe = p.kernel_available(); "
            "torch_loaded = 'torch' in sys.modules; from quantreg_cpu_mxfp4 import kernel; "
            "print(json.dumps([p.__file__, probe, torch_loaded, kernel.status()]))")
    where, (ok, why), torch_loaded, (status_ok, status_why) = json.loads(python(code, env_for(copies[case])))
    assert where.startswith(str(copies[case]))
    assert ok is False and why.startswith(f"unavailable: {CASES[case]}"), why
    assert status_ok is False and status_why == why.removeprefix("unavailable: ")
    assert not torch_loaded  # the probe stays torch-free


def test_the_installed_library_loads_and_the_probe_says_so() -> None:
    """The control: the real library, loaded by the probe in a process without torch; torch imported
    afterwards runs with its own OpenMP runtime, the one the library uses (one ``libgomp`` mapped: without
    the probe loading torch's first, torch would have bound to the system's)."""
    _installed_package()
    code = ("import json, sys, quantreg_cpu_mxfp4.probe as p; probe = p.kernel_available(); "
            "loaded = 'torch' in sys.modules; import torch; from quantreg_cpu_mxfp4 import kernel; "
            "maps = open('/proc/self/maps').read().splitlines(); "
            "gomp = sorted({line.split()[-1] for line in maps if 'libgomp' in line}); "
            "print(json.dumps([probe, loaded, kernel.status(), gomp, torch.__file__]))")
    (ok, why), torch_loaded, (status_ok, _), gomp, torch_file = json.loads(python(code, env_for(Path("/nonexistent"))))
    assert ok is True and why.startswith(f"kernel loaded: {LIBRARY} (ABI 3), ISA path "), why
    assert not torch_loaded and status_ok is True
    assert len(gomp) == 1, gomp
    bundled = Path(torch_file).parent / "lib" / "libgomp.so.1"
    if bundled.is_file():  # pip's torch ships its own runtime: that one
        assert Path(gomp[0]).resolve() == bundled.resolve(), gomp


@pytest.mark.parametrize("case", sorted(CASES))
def test_explain_and_plan_pass_the_method_over_with_the_reason(case: str, copies: dict[str, Path],
                                                               tmp_path: Path) -> None:
    """A user chain ``[cpu_mxfp4, mxfp4_reference]``: the next method decides, and both readers say why."""
    pytest.importorskip("quantreg_hpu_mxfp4", reason="plugin #1 (mxfp4_reference) is the next method")
    table = chain_table(tmp_path, "cpu_mxfp4, mxfp4_reference")
    env = env_for(copies[case], QUANTREG_CONFIG=str(table))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "quantreg", "explain", *KEY, "--json"], capture_output=True,
                          text=True, env=env, timeout=300)
    took = time.monotonic() - started
    # a library that blocks at load: explain answers within the probe timeout plus start-up (a few seconds)
    assert done.returncode == 0 and took < PROBE_TIMEOUT + 8, (took, done.stderr[-2000:])
    data = json.loads(done.stdout)
    text = json.dumps(data)
    assert data["method"] == "mxfp4_reference", text[:3000]
    assert f"unavailable: {CASES[case]}" in text, text[:3000]
    human = subprocess.run([sys.executable, "-m", "quantreg", "explain", *KEY], capture_output=True, text=True,
                           env=env, timeout=300).stdout
    assert "cpu_mxfp4" in human and CASES[case] in " ".join(human.split()), human
    assert "kernel built" not in human and "kernel loaded" not in human

    from quantreg.models.gpt_oss import tiny_gpt_oss_config

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_gpt_oss_config()))
    done = subprocess.run([sys.executable, "-m", "quantreg", "plan", str(model), "--device", "cpu", "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    plan = json.loads(done.stdout)
    assert plan["devices"]["cpu"]["method"] == "mxfp4_reference", done.stdout[:3000]
    assert CASES[case] in json.dumps(plan), done.stdout[:3000]


@pytest.mark.vllm
def test_the_constructor_refuses_and_the_kit_says_why(copies: dict[str, Path]) -> None:
    """Built directly (as the seam builds it) the method raises at once, naming the library; the kit's
    checks that build it are SKIPPED with that reason on this install, never FAILED or passed."""
    pytest.importorskip("vllm")
    code = ("from quantreg_cpu_mxfp4.method import CpuMxfp4MoEMethod\n"
            "from quantreg.testing.harness import VllmMoeHarness\n"
            "with VllmMoeHarness() as h:\n"
            "    config = h.moe_config()\n"
            "    try:\n"
            "        CpuMxfp4MoEMethod(config)\n"
            "    except RuntimeError as exc:\n"
            "        print(exc)\n"
            "    else:\n"
            "        print('built')\n")
    said = python(code, env_for(copies["wrong-abi"])).strip().splitlines()[-1]
    assert said.startswith("cpu_mxfp4 cannot run in this process: " + CASES["wrong-abi"]), said
    done = subprocess.run([sys.executable, "-m", "quantreg", "check-method", "cpu_mxfp4", "--device", "cpu",
                           "--json"], capture_output=True, text=True, env=env_for(copies["wrong-abi"]), timeout=600)
    report = json.loads(done.stdout)
    rows = {r["check"]: r for r in report["results"]}
    assert done.returncode == 0 and report["ok"], done.stdout[-3000:]
    assert rows["probe"]["status"] == "PASS" and CASES["wrong-abi"] in rows["probe"]["detail"]
    for check in ("options", "weights"):
        assert rows[check]["status"] == "SKIPPED", rows[check]
        assert "its constructor refuses to build here: RuntimeError: cpu_mxfp4 cannot run" in rows[check]["detail"]
    assert rows["first-forward"]["status"] == "SKIPPED" and CASES["wrong-abi"] in rows["first-forward"]["detail"]


# -- real vLLM on the tiny model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quantreg.tiny.checkpoint import write_tiny_gpt_oss
    from quantreg.tiny.tokenizer import write_tokenizer

    return Path(write_tokenizer(write_tiny_gpt_oss(tmp_path_factory.mktemp("broken-lib-model") / "tiny")))


@pytest.mark.vllm
def test_lenient_vllm_serves_through_the_next_method_of_the_chain(copies: dict[str, Path], tiny: Path,
                                                                  tmp_path: Path) -> None:
    """A library of another ABI version, a user chain ``[cpu_mxfp4, mxfp4_reference]``: vLLM starts and
    generates with ``mxfp4_reference`` in every MoE layer, and its log says why cpu_mxfp4 was passed over."""
    pytest.importorskip("vllm")
    pytest.importorskip("quantreg_hpu_mxfp4", reason="plugin #1 (mxfp4_reference) is the next method")
    from quantreg.testing.vllm_run import DEMO_PROMPTS, run_vllm

    table = chain_table(tmp_path, "cpu_mxfp4, mxfp4_reference")
    result = run_vllm(tiny, DEMO_PROMPTS[:2], max_tokens=2, multiprocessing=False, workdir=tmp_path / "run",
                      timeout=600.0, env=env_for(copies["wrong-abi"], QUANTREG_CONFIG=str(table)))
    assert result.ok, (result.error or "") + result.log[-6000:]
    assert all(len(t) == 2 for t in result.token_ids)
    assert {i.quant_method for worker in result.worker_moe_layers for i in worker} == {REFERENCE}
    assert CASES["wrong-abi"] in result.log, result.log[-6000:]


@pytest.mark.vllm
def test_strict_vllm_stops_with_one_line_naming_the_library(copies: dict[str, Path], tiny: Path,
                                                           tmp_path: Path) -> None:
    """Strict mode, a file that is not a library, a rule naming ``cpu_mxfp4`` alone: no start, one
    ``quantreg (strict):`` line naming why cpu_mxfp4 cannot run (never a first-forward failure).
    (Strict, a chain that moves on to a method that runs is no fault: it serves, as lenient does.)"""
    pytest.importorskip("vllm")
    from quantreg.testing.vllm_run import DEMO_PROMPTS, run_vllm

    table = chain_table(tmp_path, "cpu_mxfp4")
    result = run_vllm(tiny, DEMO_PROMPTS[:1], max_tokens=1, multiprocessing=False, workdir=tmp_path / "run",
                      timeout=600.0,
                      env=env_for(copies["not-a-library"], QUANTREG_CONFIG=str(table), QUANTREG_STRICT="1"))
    assert not result.ok
    lines = [line for line in result.log.splitlines() if "QuantregError: quantreg (strict):" in line]
    assert lines, result.log[-6000:]
    assert CASES["not-a-library"] in lines[0] and "cpu_mxfp4" in lines[0], lines[0]
    assert "moe_forward" not in result.log and "first forward" not in result.log
