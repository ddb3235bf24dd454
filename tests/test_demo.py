"""The demo's ending: one verdict against stated bounds, and the branch each host kind takes.

Why without vLLM: the demo's two vLLM runs are covered by the e2e tests that use the same runner
(tests/e2e/test_mxfp4_reference.py measures these very bounds); what the demo adds is the judgement
of two finished runs and the host branch, which are pure functions of real ``RunResult`` values,
real MoE probe files (``torch.save``, as the runner's child writes them) and real host facts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from quantreg import host
from quantreg.demo.command import LOGPROB_BOUND, _max_moe_diff, own_method_plan, stated_error, verdict
from quantreg.testing.vllm_run import RunResult
from quantreg.vllm_limits import vllm_cpu_mxfp4_kernel

TOKENS = [[5, 6, 7], [8, 9, 10]]


def _run(tokens: list[list[int]] = TOKENS, returncode: int = 0, moe: Path | None = None) -> RunResult:
    return RunResult(returncode=returncode, log="", elapsed_s=1.0, token_ids=tokens, moe_outputs_path=moe)


def _probe(path: Path, scale: float, shift: float) -> Path:
    import torch

    out = torch.linspace(-scale, scale, 64).reshape(8, 8)
    torch.save({"input": torch.zeros(8, 8), "model.layers.0.mlp.experts": out + shift}, path)
    return path


def test_pass_names_every_number_and_its_bound(tmp_path: Path) -> None:
    own, routed = _run(moe=_probe(tmp_path / "a.pt", 8.6, 0.0)), _run(moe=_probe(tmp_path / "b.pt", 8.6, 0.0625))
    moe = _max_moe_diff(own, routed, 0.03)  # e.g. cpu_mxfp4 (0.02) against mxfp4_reference (0.01)
    assert moe is not None and moe[0] == pytest.approx(0.0625) and moe[1] == pytest.approx(0.03 * (8.6 + 0.0625))
    ok, line = verdict(own, routed, 0.053, moe)
    assert ok, line
    assert line == ("PASS: tokens equal 6/6, max logprob diff 0.053 ≤ 0.15, max MoE output diff 0.0625 ≤ 0.2599 "
                    "(the two methods' stated errors of the layer's largest output)")


def test_fail_says_which_bound_was_exceeded(tmp_path: Path) -> None:
    own = _run(moe=_probe(tmp_path / "a.pt", 8.6, 0.0))
    routed = _run([[5, 6, 1], [8, 9, 10]], moe=_probe(tmp_path / "b.pt", 8.6, 0.5))
    ok, line = verdict(own, routed, LOGPROB_BOUND * 2, _max_moe_diff(own, routed, 0.03))
    assert not ok
    assert line.startswith("FAIL: tokens equal 5/6 FAILED, max logprob diff 0.300 ≤ 0.15 FAILED, "
                           "max MoE output diff 0.5000 ≤ 0.2730")
    assert line.endswith("FAILED")


def test_the_bound_is_each_methods_stated_error() -> None:
    """A method's own ``quantreg_tolerance`` where it states one; vLLM's own (and an unknown name) get the
    kit's default: the demo's MoE bound is derived from what the methods promise, not from one host's run."""
    from quantreg import Registry
    from quantreg.error_measure import DEFAULT_TOLERANCE

    registry = Registry.build()
    assert stated_error(registry, "vllm") == stated_error(registry, "no_such_method") == DEFAULT_TOLERANCE
    if "mxfp4_reference" in registry.methods and registry.methods["mxfp4_reference"].availability("cpu").ok:
        pytest.importorskip("vllm", reason="vLLM is not installed in this environment")
        assert stated_error(registry, "mxfp4_reference") == 0.01
    if "cpu_mxfp4" in registry.methods:
        pytest.importorskip("vllm", reason="vLLM is not installed in this environment")
        assert stated_error(registry, "cpu_mxfp4") == 0.02


def test_a_failed_run_is_a_fail_not_a_number() -> None:
    ok, line = verdict(_run(returncode=1, tokens=[]), _run(), None, None)
    assert (ok, line) == (False, "FAIL: the installed tables run failed (see its error above)")


@pytest.mark.parametrize("kind", ["avx2", "amx"])
def test_each_host_kind_gets_its_branch(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """AMX: vLLM's own MXFP4 kernel on the MXFP4 checkpoint. Without: the refusal is the expected outcome."""
    for name, value in host.simulate(kind).items():
        monkeypatch.setenv(name, value)
    if not host.host_facts().is_x86:
        pytest.skip("host kinds are x86 kinds")
    use_mxfp4, note = own_method_plan(vllm_cpu_mxfp4_kernel())
    assert use_mxfp4 is (kind == "amx")
    if kind == "amx":
        assert note.startswith("vLLM's own MXFP4 kernel on the MXFP4 checkpoint: this host can run it")
    else:
        assert note.startswith("expected on this host: vLLM alone refuses the MXFP4 checkpoint ('No MXFP4 MoE "
                               "backend supports the deployment configuration'), because this CPU")
        assert "has no AMX: amx_tile, amx_bf16 missing" in note and "bf16 twin" in note
