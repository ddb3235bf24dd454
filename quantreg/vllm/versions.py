"""Which vLLM releases quantreg is proven on, and the one place version differences live.

``TESTED`` is the range ``scripts/compat.sh`` runs the compat subset of the real-vLLM tests on
(one virtualenv per release in ``TESTED_RELEASES``, see docs/compat.md). Outside it quantreg
still tries (the seam checks what it patches by itself), but says so once: ``check_tested``
returns the message; ``doctor`` and the start-up log print it.

Pure Python on purpose: ``register()`` runs in every vLLM process before any model code, and
reading a version must not cost a vLLM import (3-4 s) or need ``packaging``. The installed
version comes from distribution metadata (``installed_version``), never from ``import vllm``.

Version-gated helpers, when a release needs one, go here and are named by the release that
needs them (``..._v0_28``), so the call sites in seam.py/context.py stay version-free and a
release leaving the tested range deletes exactly one function.
"""

from __future__ import annotations

import logging

from ..environment import vllm_distribution
from ..version_spec import release, satisfies

logger = logging.getLogger("vllm.quantreg")

#: the tested range, as a PEP 440 specifier set restricted to ``>=, >, <=, <, ==, !=``
TESTED = ">=0.28,<0.33"
#: the releases ``scripts/compat.sh`` runs by default (its matrix); all inside ``TESTED``
TESTED_RELEASES = ("0.28.0", "0.31.0", "0.32.0")

_warned: set[str] = set()


def check_tested(version: str | None, tested: str = TESTED) -> str | None:
    """``None`` when ``version`` is inside the tested range, else the message to show once.

    ``version=None`` means vLLM's distribution metadata was not found (a vLLM on ``sys.path``
    without dist-info), which is just as unproven as a release outside the range.
    """
    if version is not None and satisfies(version, tested):
        return None
    shown = version if version is not None else "of unknown version (no vLLM distribution metadata)"
    return (f"quantreg: vLLM {shown} is outside the tested range {tested} "
            f"(tested: {', '.join(TESTED_RELEASES)}); quantreg still routes MoE methods, "
            "but check `quantreg doctor` and run scripts/compat.sh or scripts/vllm_compat_check.py for this release")


def installed_version() -> str | None:
    """The installed vLLM's version from distribution metadata (no vLLM import), or ``None``:
    :func:`quantreg.environment.vllm_distribution`, the one lookup (doctor and probes use it too)."""
    found = vllm_distribution()
    return found[1] if found is not None else None


def warn_if_untested(version: str | None = None) -> str | None:
    """Log ``check_tested``'s message once per process as a WARNING; return it (``None`` inside the range).

    For the start-up log: ``register()`` runs in every vLLM process, and each should say it
    once, not once per layer. ``version`` defaults to :func:`installed_version`.
    """
    message = check_tested(installed_version() if version is None else version)
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
