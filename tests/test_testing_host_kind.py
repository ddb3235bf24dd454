"""quantreg.testing.host_kind: a child process started with ``without_amx_env`` sees no AMX, in torch
(what vLLM asks) and in quantreg (what it believes), on whichever host runs the test; and the
"with AMX" branch skips with a reason naming the hardware where the host has none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from core_support import HOST_KINDS, HostKind

from quantreg import settings
from quantreg.testing.host_kind import SITECUSTOMIZE, needs_real_amx, without_amx_env

CHILD = """
import json, torch
from quantreg.host import host_facts
from quantreg.testing.host_kind import amx_hidden, real_amx
from quantreg.testing.vllm_run import vllm_cpu_mxfp4_kernel_available
print(json.dumps({"torch_cpu": bool(torch.cpu._is_amx_tile_supported()),
                  "real_amx": real_amx(), "hidden": amx_hidden(), "kernel": vllm_cpu_mxfp4_kernel_available(),
                  "kind": host_facts().kind, "simulated": host_facts().simulated}))
"""


def run_child(extra: dict[str, str]) -> dict[str, object]:
    env = {**os.environ, **extra}
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_child_without_amx_sees_none_in_torch_and_in_quantreg(host_kind: HostKind) -> None:
    hidden = run_child(without_amx_env())
    assert hidden == {"torch_cpu": False, "real_amx": False, "hidden": True, "kernel": False,
                      "kind": "avx2" if host_kind.facts.is_x86 and host_kind.facts.has("avx2", "fma") else "other",
                      "simulated": True}
    plain = run_child({})
    assert plain["hidden"] is False and plain["real_amx"] == host_kind.real_amx  # nothing leaks without the env
    assert plain["torch_cpu"] == host_kind.real_amx


def test_without_amx_env_keeps_the_callers_pythonpath(tmp_path: os.PathLike[str]) -> None:
    env = without_amx_env({"PYTHONPATH": "/somewhere/else"})
    first, rest = env["PYTHONPATH"].split(os.pathsep, 1)
    assert rest == "/somewhere/else" and env[settings.HIDE_AMX] == "1"
    with open(os.path.join(first, "sitecustomize.py")) as f:
        assert f.read() == SITECUSTOMIZE


@pytest.mark.parametrize("kind", HOST_KINDS)
def test_vllm_env_gives_each_branch_or_skips_naming_the_hardware(host_kind: HostKind, kind: str) -> None:
    if kind == "amx" and not host_kind.real_amx:
        with pytest.raises(pytest.skip.Exception, match="needs real AMX hardware"):
            host_kind.vllm_env(kind)
        assert "no amx_tile" in needs_real_amx("x")
        return
    env = host_kind.vllm_env(kind, {"A": "1"})
    assert env["A"] == "1"
    assert (settings.HIDE_AMX in env) == (kind == "avx2" and host_kind.real_amx)  # hidden only where there is AMX
