"""Helpers the e2e test modules import (a unique module name: ``conftest`` is not importable by name).

:class:`VllmRuns` is the type of the session fixture ``vllm_run`` (tests/e2e/conftest.py), and
:func:`env_with` the environment for a run that puts a test plugin directory on ``PYTHONPATH``.

History (issue 24 class 5): ``VllmRuns`` moved here from conftest.py so tests can annotate
``vllm_run: VllmRuns`` (six modules had ``VllmRun = Any``); ``env_with`` was written twice
(test_seam.py, test_verify_vllm.py), ``_free_port`` twice (test_multirank.py, test_quickstart.py: now
:func:`quantreg.testing.serving.free_port`) and the ``reference_table`` fixture three times (now once,
in conftest.py).
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from core_support import installed_copy


class VllmRuns:
    """Session memo of :func:`~quantreg.testing.vllm_run.run_vllm` calls, optionally concurrent.

    ``runs(model_dir, **kwargs)`` returns the :class:`RunResult` (waiting if needed);
    ``runs.start(model_dir, **kwargs)`` only launches it. Each run is a separate process tree,
    so a module can start every run it needs at once: vLLM start-up is mostly single-threaded
    imports (8-10 s per process, three processes with multiprocessing), so overlapping runs
    roughly halves the wall time even on two cores. ``QUANTREG_E2E_JOBS`` caps the overlap
    (default 3, 2 per pytest-xdist worker; 1 = strictly one after another). Prompts default to ``DEMO_PROMPTS``; keyword
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


def env_with(plugin: Path, **extra: str) -> dict[str, str]:
    """A run's environment with the test plugin directory ``plugin`` first on ``PYTHONPATH``, no user
    table and no decisions trail from the caller's shell, then ``extra``."""
    path = os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {"PYTHONPATH": path, "QUANTREG_CONFIG": "", "QUANTREG_DECISIONS": "", **extra}


HERE = Path(__file__).resolve().parent


def plugin_site(factory: pytest.TempPathFactory, name: str) -> Path:
    """The test plugin ``tests/e2e/<name>_plugin`` (modules ``quantreg_<name>_plugin`` and
    ``quantreg_<name>_methods``) as an installed distribution ``quantreg-<name>-plugin``: modules and
    dist-info in one new sys.path entry, its ``quantreg`` entry point named ``name``."""
    return installed_copy(factory.mktemp(f"{name}-plugin-site"), HERE / f"{name}_plugin",
                          (f"quantreg_{name}_plugin.py", f"quantreg_{name}_methods.py"), f"quantreg-{name}-plugin",
                          f"{name} = quantreg_{name}_plugin")


def one_rule_tables(root: Path, rules: dict[str, str]) -> dict[str, Path]:
    """A user table ``root/<name>.yaml`` per entry of ``rules``, holding that one rule (the text after
    ``  - ``; its first line is line 3 of the file, the line a decision names)."""
    paths = {}
    for name, rule in rules.items():
        paths[name] = root / f"{name}.yaml"
        paths[name].write_text(f"version: 1\nrules:\n  - {rule}\n")
    return paths


#: The tiny GPT-OSS MXFP4 model's key on the CPU, as a table's match fields.
MXFP4_KEY = "quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu"


def key_table(path: Path, rules: list[tuple[str | None, str]]) -> Path:
    """A user table of rules ``(tokens range or None, method)`` for :data:`MXFP4_KEY`, written to ``path``."""
    lines = ["version: 1", "rules:"]
    for tokens, method in rules:
        extra = f", tokens: \"{tokens}\"" if tokens is not None else ""
        lines += [f"  - match: {{{MXFP4_KEY}{extra}}}", f"    method: {method}"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


#: The verify layer tests' MoE layer prefix (test_verify_layer.py, test_verify_contained.py).
VERIFY_PREFIX = "model.layers.0.mlp.experts"


def verify_inputs() -> tuple[Any, Any, Any]:
    """The verify layer tests' seeded inputs: a GPT-OSS MXFP4 expert set (8 experts, hidden 64,
    intermediate 96, with biases), 6 tokens' hidden states and their router logits (imports torch)."""
    from quantreg.models.gpt_oss_moe import random_gpt_oss_mxfp4_experts, random_hidden_states, random_router_logits

    return (random_gpt_oss_mxfp4_experts(8, 64, 96, bias=True, seed=1), random_hidden_states(6, 64, seed=2),
            random_router_logits(6, 8, seed=3))
