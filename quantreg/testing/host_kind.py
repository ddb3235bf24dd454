"""Which kind of CPU a vLLM child process sees: this host's own, or an AMX host made to look like one without.

Why: on an AMX host vLLM's own CPU MXFP4 kernel (``CPUExpertsMxfp4``) runs GPT-OSS MXFP4; on any
other CPU vLLM refuses it. Tests that depend on that have two branches of truth, and a session
only ever sees its own host's. Two seams let one host check both where it physically can:

* quantreg's beliefs: :func:`quantreg.host.simulate` (``QUANTREG_HOST_CPU_FLAGS``);
* vLLM's own check: vLLM 0.26-0.32 asks ``torch.cpu._is_amx_tile_supported()`` everywhere
  (experts/cpu_moe.py ``CPUExpertsMxfp4._supports_current_device``, platforms/cpu.py, the CPU
  attention and linear kernels; ``_is_amx_fp16_supported`` for fp16). A child
  started with :func:`without_amx_env` gets a ``sitecustomize`` on its ``PYTHONPATH`` that makes
  that answer ``False`` in the child and in every vLLM worker it spawns (they inherit the
  environment), so an AMX host behaves exactly like one without.

The reverse cannot be simulated: a host without AMX cannot run AMX instructions, so the "with
AMX" branch of a vLLM run needs real AMX hardware (:func:`needs_real_amx` is the skip reason).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from .. import settings
from ..host import host_facts, simulate
from ..writing import make_directory, replace_file

#: Set (to ``1``) in a child's environment by :func:`without_amx_env`; read by the sitecustomize.

SITECUSTOMIZE = f'''"""quantreg.testing.host_kind: this process (and the vLLM workers it starts) sees no AMX."""
import os

if os.environ.get("{settings.HIDE_AMX}") == "1":
    import torch  # vLLM imports it anyway; patched before vLLM asks

    def _no_amx() -> bool:
        return False

    torch.cpu._is_amx_tile_supported = _no_amx
    if hasattr(torch.cpu, "_is_amx_fp16_supported"):
        torch.cpu._is_amx_fp16_supported = _no_amx
'''


def _sitecustomize_dir() -> Path:
    """A directory holding only the ``sitecustomize.py`` above (written once per process)."""
    path = Path(tempfile.gettempdir()) / f"quantreg-hide-amx-{os.getuid() if hasattr(os, 'getuid') else 0}"
    target = path / "sitecustomize.py"
    if not target.exists() or target.read_text() != SITECUSTOMIZE:
        make_directory(path)
        replace_file(target, SITECUSTOMIZE)
    return path


def without_amx_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment additions for a child that must behave like a host without AMX, for vLLM and quantreg.

    ``base`` is the environment the child would get otherwise (default ``os.environ``): its
    ``PYTHONPATH`` is kept behind the sitecustomize directory.
    """
    env = dict(os.environ if base is None else base)
    old = env.get("PYTHONPATH", "")
    path = str(_sitecustomize_dir())
    return {settings.HIDE_AMX: "1", "PYTHONPATH": path + (os.pathsep + old if old else ""), **simulate("avx2")}


def amx_hidden() -> bool:
    """Whether this process was started by :func:`without_amx_env`."""
    return os.environ.get(settings.HIDE_AMX) == "1"


def real_amx() -> bool:
    """Whether this host's CPU really has AMX tiles, as torch (and so vLLM) reads them, unless hidden.

    Not :func:`quantreg.host.host_facts`: that is what quantreg *believes* and may be simulated;
    this is what vLLM will find when it runs here.
    """
    if amx_hidden():
        return False
    import platform

    import torch

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return bool(torch.cpu._is_amx_tile_supported())


def needs_real_amx(what: str) -> str:
    """The skip reason for a branch only real AMX hardware can show (names this host's CPU)."""
    facts = host_facts()
    model = facts.model_name or facts.machine
    return (f"{what} needs real AMX hardware (vLLM's own CPU MXFP4 kernel runs only there); this host: "
            f"{model}, kind {facts.kind}, no amx_tile")
