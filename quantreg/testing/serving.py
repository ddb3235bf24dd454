"""A real OpenAI-compatible vLLM server for tests: started on 127.0.0.1 and a free port, ended by PID.

Why here: every test that proves "the operator's path" (``python -m vllm.entrypoints.openai.api_server``
on a checkpoint, then real HTTP) needs the same bounded start (``/health`` polled), the same
environment (``VLLM_CPU_KVCACHE_SPACE=1``: vLLM-CPU refuses to start without a KV-cache size; the
caller's ``QUANTREG_*`` variables removed so only what the test passes decides) and the same
teardown (the server's own session, TERM then KILL, so only its processes end). quantreg's own
serving tests and plugins' tests share it. No torch or vLLM import here: the server is a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import settings
from ..writing import open_log
from .vllm_run import group_alive

#: Bounded wait for /health; healthy in 32-53 s eager on a quiet machine, compiling adds 20-60 s
#: (QUANTREG_SERVE_TIMEOUT overrides).
START_TIMEOUT = float(settings.value(settings.SERVE_TIMEOUT))
REQUEST_TIMEOUT = 60.0
#: Environment variables of the caller that would change what these servers decide.
QUANTREG_VARS = (settings.CONFIG, settings.STRICT, settings.PLUGINS, settings.DISABLE_PLUGINS,
                 settings.FINGERPRINT, settings.DECISIONS)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A started (and, by the time tests see it, finished starting) API server."""

    proc: subprocess.Popen[bytes]
    port: int
    model: str
    log_path: Path
    healthy: bool = False
    returncode: int | None = None
    startup_s: float = 0.0
    trail: Path | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, path: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as resp:
            return json.loads(resp.read())

    def stream(self, path: str, body: dict[str, Any]) -> list[Any]:
        """POST with ``stream: true``; the parsed server-sent ``data:`` events up to ``[DONE]``."""
        req = urllib.request.Request(self.base + path, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        events: list[Any] = []
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    events.append(data)
                    break
                events.append(json.loads(data))
        return events


def stop(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """End the server's process group (its own session: only its processes), TERM then KILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None and not group_alive(proc.pid):
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if proc.poll() is not None and not group_alive(proc.pid):
                break
            time.sleep(0.2)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass


def start_server(model: Path, workdir: Path, extra_args: Sequence[str] = (),
                 env: dict[str, str] | None = None, *, eager: bool = False) -> Server:
    """Start the server and wait (bounded) until ``/health`` answers 200 or the process exits.

    vLLM's default mode (the model compiled, as ``vllm serve MODEL`` runs it) unless ``eager``
    (``--enforce-eager``)."""
    port = free_port()
    child_env = {k: v for k, v in os.environ.items() if k not in QUANTREG_VARS}
    child_env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1", "NO_COLOR": "1"})
    child_env.update(env or {})
    log_path = workdir / f"server-{port}.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "256",
           *(["--enforce-eager"] if eager else []), *extra_args]
    with open_log(log_path) as log_file:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                env=child_env, cwd=workdir, start_new_session=True)
    server = Server(proc, port, str(model), log_path)
    start = time.monotonic()
    try:
        while time.monotonic() - start < START_TIMEOUT:
            code = proc.poll()
            if code is not None:
                server.returncode = code
                break
            try:
                with urllib.request.urlopen(server.base + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        server.healthy = True
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
    except BaseException:
        stop(proc)
        raise
    server.startup_s = time.monotonic() - start
    if not server.healthy and server.returncode is None:  # timed out: end it, keep the log for the failure
        stop(proc)
        server.returncode = proc.returncode
    return server
