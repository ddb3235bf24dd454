"""What quantreg knows, without building a layer, about keys vLLM's own method cannot run here.

Why: ``explain`` and ``plan`` answer ``vllm`` ("keep vLLM's own method") for a key, but on some
hosts vLLM has no kernel for that key at all and fails at start-up; e.g. vLLM 0.32 on a CPU
without AMX refuses GPT-OSS MXFP4 ("No MXFP4 MoE backend supports the deployment
configuration"). The operator should read that before starting a server, so such knowledge is
kept here as declarative :class:`VllmLimitation` values: a key pattern, the reason, the vLLM
source it was read from, and an optional cheap check of this host (``/proc/cpuinfo`` flags, a
module's presence) that must never import vLLM or torch.

Plugins add limitations for their devices through the ``register_vllm_limitations`` hook (see
:func:`quantreg.hookspecs.register_vllm_limitations` and docs/plugins.md); the built-in ones are in
:data:`BUILTIN_LIMITATIONS`. :func:`vllm_backend_note` answers one key.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from . import settings
from .host import AMX_FLAGS, HostFacts, host_facts, parse_cpuinfo
from .keys import EXPERTS, WILDCARD, Key, as_key

Check = Callable[[], bool]
PatternValue = str | tuple[str, ...]


@dataclass(frozen=True)
class VllmLimitation:
    """vLLM's own method cannot run keys matching this pattern (when ``applies`` says so).

    ``quant_format``/``model_type``/``device`` are a value, a tuple of values or ``"*"``.
    ``applies`` is a callable (or ``"module:function"``) telling whether the limitation holds on
    this host; ``None`` means always. It must be cheap and must not import vLLM; one that raises
    counts as "does not apply" (a wrong warning is worse than a missing one).
    ``source`` says where in vLLM the fact was read, so it can be re-checked on upgrades.
    """

    reason: str
    quant_format: PatternValue = WILDCARD
    model_type: PatternValue = WILDCARD
    device: PatternValue = WILDCARD
    applies: Check | str | None = None
    source: str = ""
    plugin: str = ""

    def matches(self, key: Key) -> bool:
        """Limitations are about vLLM's MoE kernels: a dense layer's own method (a GEMM) is not limited."""
        if as_key(key).layer != EXPERTS:
            return False
        return all(_field_matches(p, v) for p, v in
                   zip((self.quant_format, self.model_type, self.device), key))

    def holds(self) -> bool:
        if self.applies is None:
            return True
        from .hookcall import call  # the one caller of plugin code: SystemExit contained, "still ..." named

        applies = self.applies

        def check() -> Any:
            return (_load(applies) if isinstance(applies, str) else applies)()

        result, error = call(f"checking 'applies' of a vLLM limitation from plugin '{self.plugin or 'quantreg'}'",
                             check)
        return error is None and result is True

    def note(self) -> str:
        text = f"vLLM's own method will fail for this key here: {self.reason}"
        if self.source:
            text += f" [{self.source}]"
        if self.plugin:
            text += f" (from plugin '{self.plugin}')"
        return text


def _field_matches(pattern: PatternValue, value: str) -> bool:
    if isinstance(pattern, str):
        return pattern == WILDCARD or pattern == value
    return WILDCARD in pattern or value in pattern


def _load(ref: str) -> Check:
    module, _, attr = ref.partition(":")
    mod = importlib.import_module(module)
    fn: Check = getattr(mod, attr)
    return fn


# -- vLLM's own CPU MXFP4 kernel on this host (the facts: :mod:`quantreg.host`, the one home) -------


@dataclass(frozen=True)
class KernelVerdict:
    """Whether vLLM's own CPU MXFP4 MoE kernel can run on this host, why, and the facts it rests on.

    Why one value: ``doctor``, the demo and the ``explain``/``plan`` limitation must give the same
    answer on the same host (the two CI kinds differ exactly here), so they all ask this.
    """

    runs: bool
    reason: str
    emulation: bool
    """``amd-quark`` is importable: vLLM's emulation backend can serve MXFP4 even without the kernel."""
    host: dict[str, object]

    def as_json(self) -> dict[str, object]:
        return {"runs": self.runs, "reason": self.reason, "emulation": self.emulation, "host": self.host}


def vllm_cpu_mxfp4_kernel(facts: HostFacts | None = None) -> KernelVerdict:
    """vLLM 0.32's CPU MXFP4 kernel (``CPUExpertsMxfp4``) runs on an x86 CPU with AMX tiles and bf16.

    It mirrors ``CPUExpertsMxfp4._supports_current_device`` from :func:`quantreg.host.host_facts`
    (no vLLM, no torch), so ``QUANTREG_HOST_CPU_FLAGS`` changes the answer like every other.
    """
    facts = facts or host_facts()
    emulation = importlib.util.find_spec("quark") is not None
    cpu = ", ".join(x for x in (facts.vendor, facts.model_name) if x) or "unknown CPU"
    simulated = f" (flags simulated by {settings.HOST_CPU_FLAGS})" if facts.simulated else ""
    if not facts.is_x86:
        return KernelVerdict(False, f"the kernel is x86-only and this host is {facts.machine}{simulated}",
                             emulation, facts.as_json())
    missing = [flag for flag in AMX_FLAGS if not facts.has(flag)]
    if missing:
        return KernelVerdict(
            False, f"this CPU ({cpu}, kind {facts.kind}) has no AMX: {', '.join(missing)} missing from its "
            f"flags{simulated}; vLLM 0.32 refuses GPT-OSS MXFP4 on it ('No MXFP4 MoE backend supports the "
            "deployment configuration') unless a rule routes the key to a quantreg method",
            emulation, facts.as_json())
    return KernelVerdict(True, f"this CPU ({cpu}, kind {facts.kind}) has {' and '.join(AMX_FLAGS)}{simulated}, "
                         "which CPUExpertsMxfp4 needs", emulation, facts.as_json())


def cpu_mxfp4_unsupported(cpuinfo: str | None = None) -> bool:
    """vLLM 0.32 has no CPU MXFP4 MoE backend here: no x86 AMX kernel and no ``amd-quark`` emulation."""
    facts = host_facts()
    if cpuinfo is not None:  # another CPU's /proc/cpuinfo, on this host's architecture
        facts = replace(facts, cpu_flags=parse_cpuinfo(cpuinfo)[0])
    verdict = vllm_cpu_mxfp4_kernel(facts)
    return not (verdict.runs or verdict.emulation)


BUILTIN_LIMITATIONS: tuple[VllmLimitation, ...] = (
    VllmLimitation(
        reason=("vLLM 0.32's only CPU MXFP4 MoE kernel (CPUExpertsMxfp4) needs an x86 CPU with AMX "
                "(amx_tile/amx_bf16 in /proc/cpuinfo), and its emulation backend needs the amd-quark "
                "package; neither is here, so vLLM stops with 'No MXFP4 MoE backend supports the "
                "deployment configuration'"),
        quant_format=("gpt_oss_mxfp4", "mxfp4"),
        device="cpu",
        applies=cpu_mxfp4_unsupported,
        source=("vllm/model_executor/layers/fused_moe/experts/cpu_moe.py:624 "
                "CPUExpertsMxfp4._supports_current_device; ocp_mx_emulation_moe.py:130; "
                "fused_moe/oracle/mxfp4.py:734"),
    ),
)


def vllm_backend_note(key: Key | tuple[str, str, str],
                      limitations: Iterable[VllmLimitation] | None = None) -> str | None:
    """The note for ``key`` if vLLM's own method is known to fail for it on this host, else ``None``.

    ``limitations`` defaults to :data:`BUILTIN_LIMITATIONS`; pass those of
    :func:`quantreg.loading.plugin_limitations` as well to include plugins' knowledge. Several notes are joined.
    """
    key = as_key(key)
    pool: Sequence[VllmLimitation] = tuple(BUILTIN_LIMITATIONS if limitations is None else limitations)
    notes = [lim.note() for lim in pool if lim.matches(key) and lim.holds()]
    return "; ".join(notes) if notes else None
