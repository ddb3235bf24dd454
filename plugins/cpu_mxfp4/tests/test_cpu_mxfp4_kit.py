"""quantreg's conformance kit on ``cpu_mxfp4``: every check, on both ISA paths, and one real GPT-OSS-20B layer.

Real vLLM layers (``FusedMoEFactory`` under a vLLM config), built, loaded and run by the kit's
harness the way vLLM does it (:mod:`quantreg.testing.harness`); ``QUANTREG_CPU_MXFP4_ISA=avx2``
forces the kernel's baseline path, so the AVX2 code is checked on AVX-512 hosts too.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("quantreg_cpu_mxfp4", reason="quantreg-cpu-mxfp4 is not installed in this venv "
                    "(compat.sh installs it where the release pins the main venv's torch)")

import quantreg
from quantreg.testing import CHECK_IDS, run_checks
from quantreg.testing.report import Status

pytestmark = pytest.mark.vllm

NUMERIC = ["forward-bias", "forward-no-bias", "expert-parallel", "deterministic"]


def registry() -> quantreg.Registry:
    return quantreg.Registry.build(env={})


@pytest.mark.compat  # scripts/compat.sh: the method in real vLLM layers of every release of the matrix
@pytest.mark.parametrize("isa", ["default", "avx2"])
def test_every_check_passes_on_both_isa_paths(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every check on the default path; the numerical ones again on the forced AVX2 baseline."""
    from quantreg_cpu_mxfp4 import kernel

    if isa == "avx2":
        monkeypatch.setenv("QUANTREG_CPU_MXFP4_ISA", "avx2")
        assert kernel.isa() == "avx2"
    else:
        monkeypatch.delenv("QUANTREG_CPU_MXFP4_ISA", raising=False)
    report = run_checks("cpu_mxfp4", registry=registry(), device="cpu", only=NUMERIC if isa == "avx2" else None)
    print(report.render())
    assert report.available and report.results
    assert all(r.status is Status.PASS for r in report.results), report.render()
    assert len(report.results) == (len(NUMERIC) if isa == "avx2" else len(CHECK_IDS))


def test_forward_at_the_gpt_oss_20b_layer_shape() -> None:
    """One 20B-shaped layer (E=32, H=I=2880, top-4), 1 and 16 tokens, against float64."""
    report = run_checks("cpu_mxfp4", registry=registry(), device="cpu", only=["forward-bias"], shape="20b")
    (result,) = report.results
    print(report.render())
    assert result.status is Status.PASS, result.detail
    assert "at E=32, H=2880, I=2880" in result.detail and report.shape == "E=32, H=2880, I=2880"


def test_check_method_refuses_a_malformed_shape_in_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "quantreg", "check-method", "cpu_mxfp4", "--shape", "7,64"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "argument --shape: expected one of small, 20b, 120b or E,H,I" in done.stderr and "'7,64'" in done.stderr


def test_resident_expert_memory_at_the_20b_shape_is_the_packed_bytes() -> None:
    """After process_weights_after_loading the layer keeps no MXFP4 parameters of its own and no bf16
    copy: packed experts + every tensor the layer still references <= 1.1 x the loaded expert bytes."""
    from quantreg_cpu_mxfp4.method import CpuMxfp4MoEMethod

    from quantreg.models.gpt_oss_moe import random_gpt_oss_mxfp4_experts
    from quantreg.testing.harness import VllmMoeHarness, method_factory

    experts = random_gpt_oss_mxfp4_experts(32, 2880, 2880, bias=True, seed=11)
    checkpoint = sum(t.numel() * t.element_size() for t in experts.tensors().values())
    with VllmMoeHarness() as harness:
        layer = harness.ready(method_factory(CpuMxfp4MoEMethod), experts, top_k=4)
        del experts
        method: Any = layer.method
        kept = [t for t in [*layer.experts.parameters(), *layer.experts.buffers()] if t.numel()]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
        resident = method.w13.nbytes + method.w2.nbytes + sum(storages.values())
        assert all(getattr(layer.experts, p).numel() == 0 for p in ("w13_weight", "w13_weight_scale", "w2_weight",
                                                                    "w2_weight_scale"))
        assert resident == method.resident_bytes()
    print(f"resident {resident / 2**20:.1f} MiB for {checkpoint / 2**20:.1f} MiB loaded (x{resident / checkpoint:.3f})")
    assert checkpoint > 400 << 20 and resident <= 1.1 * checkpoint


def test_the_readme_quotes_the_tolerance_the_kit_prints() -> None:
    """Issue 33.5: the README said 1e-2 while the kit printed 0.02 (the undeclared default)."""
    import re
    from pathlib import Path

    from quantreg_cpu_mxfp4.method import CpuMxfp4MoEMethod

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    quoted = re.search(r"`quantreg check-method cpu_mxfp4` tolerance (\S+) ", readme)
    assert quoted is not None
    # the report prints f"tolerance {tolerance:g}": the README must show that very text
    assert quoted.group(1) == f"{CpuMxfp4MoEMethod.quantreg_tolerance:g}"
