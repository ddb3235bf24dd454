"""What this host is, read once: CPU architecture, flags, vendor, cores (no torch, no vLLM).

Why one module: which MoE method can run on a CPU depends on the CPU (vLLM's own MXFP4 kernel
needs AMX; a plugin's kernel may need AVX2+FMA), and the machines this project runs on are of two
kinds (AVX2-only EPYC; AVX-512 + AMX Xeon). Every decision, note and test that depends on the CPU
asks :func:`host_facts`, so a decision is deterministic per host and the audit trail can record
the facts that made it.

**The host-facts seam.** ``QUANTREG_HOST_CPU_FLAGS`` replaces the flags read from
``/proc/cpuinfo`` (a comma- or space-separated list; entries starting with ``-`` remove a flag
from the real set, ``+`` adds one, so ``-amx_tile,-amx_bf16`` makes an AMX host look like one
without). Tests use it to run both kinds of host's branch on either kind of machine; it changes
what quantreg *believes*, never what the CPU can do, so a method that really needs a missing flag
still fails (tests that simulate must only remove flags, or not run the kernel).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from functools import cache

from . import settings
from .files import ReadRefused, read_regular
from .installed import module_available

CPUINFO = "/proc/cpuinfo"
AMX_FLAGS = ("amx_tile", "amx_bf16")
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl")
AVX2_FLAGS = ("avx2", "fma")
_AMX_EXTRA = ("amx_int8", "amx_fp16", "amx_complex")
_AVX512_EXTRA = ("avx512cd", "avx512dq", "avx512ifma", "avx512vbmi", "avx512_vbmi2", "avx512_bitalg",
                 "avx512_vpopcntdq", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx512_vp2intersect")
_CPUINFO_LIMIT = 1 << 20


@dataclass(frozen=True)
class HostFacts:
    """The facts of this host a method or a limitation may depend on."""

    machine: str
    cpu_flags: frozenset[str] = field(default_factory=frozenset)
    vendor: str = ""
    model_name: str = ""
    cores: int = 1
    simulated: bool = False
    """True when ``QUANTREG_HOST_CPU_FLAGS`` changed the flags (shown wherever facts are shown)."""

    @property
    def is_x86(self) -> bool:
        return self.machine.lower() in ("x86_64", "amd64", "i386", "i686")

    def has(self, *flags: str) -> bool:
        return all(flag in self.cpu_flags for flag in flags)

    @property
    def kind(self) -> str:
        """``amx`` (AVX-512 + AMX), ``avx512``, ``avx2`` (AVX2+FMA only) or ``other``."""
        if not self.is_x86:
            return "other"
        if self.has(*AMX_FLAGS):
            return "amx"
        if self.has(*AVX512_FLAGS):
            return "avx512"
        if self.has(*AVX2_FLAGS):
            return "avx2"
        return "other"

    @property
    def notable_flags(self) -> list[str]:
        """The flags MoE kernels care about (AMX, AVX-512, AVX2/FMA), sorted: what messages show."""
        wanted = (*AMX_FLAGS, "amx_int8", *AVX512_FLAGS, "avx512_vnni", "avx512_bf16", "avx512_fp16",
                  "avx_vnni", *AVX2_FLAGS)
        return sorted(f for f in self.cpu_flags if f in wanted)

    def as_json(self) -> dict[str, object]:
        """The facts a decision depended on, for the audit trail, ``doctor`` and ``tune``."""
        return {"machine": self.machine, "kind": self.kind, "vendor": self.vendor, "model": self.model_name,
                "cores": self.cores, "flags": self.notable_flags, "simulated": self.simulated}


def parse_cpuinfo(text: str) -> tuple[frozenset[str], str, str]:
    """(flags of the first CPU, vendor_id, model name) from ``/proc/cpuinfo`` text."""
    flags: frozenset[str] = frozenset()
    vendor = model = ""
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if not sep:
            continue
        name = name.strip()
        if name in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
        elif name == "vendor_id" and not vendor:
            vendor = value.strip()
        elif name == "model name" and not model:
            model = value.strip()
    return flags, vendor, model


def _read_cpuinfo() -> str:
    """``/proc/cpuinfo``, bounded and non-blocking (:mod:`quantreg.files`); empty when unreadable."""
    try:
        return read_regular(CPUINFO, _CPUINFO_LIMIT, head=True).decode("utf-8", errors="replace")
    except ReadRefused:
        return ""


def guess_device() -> str:
    """The device vLLM would most likely report, from what is installed and visible (no vLLM import).

    Why here: which device a tool answers for (``explain``, ``plan``, the kit, plugins' findings)
    is a fact of this host, like its CPU flags; vLLM's own answer is :mod:`quantreg.vllm.platform`'s.
    """
    if module_available("habana_frameworks"):
        return "hpu"
    if os.path.exists("/dev/nvidia0"):
        return "cuda"
    return "cpu"


def memory_available() -> int | None:
    """Bytes the kernel says can be allocated without swapping (``MemAvailable``), ``None`` unknown.

    Why here: a command that allocates from a checkpoint's declared shape (``quantreg tune``)
    must refuse a shape that cannot fit before it allocates; an oversized allocation is not an
    exception on Linux but the OOM killer, which may end another process than this one.
    """
    try:
        text = read_regular("/proc/meminfo", 1 << 16).decode("ascii", "replace")
    except ReadRefused:
        return None
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            parts = rest.split()
            if parts and parts[0].isdigit():
                return int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return None


def apply_override(real: frozenset[str], spec: str) -> frozenset[str]:
    """``QUANTREG_HOST_CPU_FLAGS``: a plain list replaces ``real``; ``-f``/``+f`` entries edit it."""
    entries = [e for e in spec.replace(",", " ").split() if e]
    if entries and all(e[0] in "+-" for e in entries):
        flags = set(real)
        for entry in entries:
            (flags.discard if entry[0] == "-" else flags.add)(entry[1:])
        return frozenset(flags)
    return frozenset(e.lstrip("+") for e in entries if not e.startswith("-"))


@cache
def _real() -> tuple[frozenset[str], str, str]:
    return parse_cpuinfo(_read_cpuinfo())


def hardware_cpu_flags() -> frozenset[str]:
    """The flags the CPU really has (``/proc/cpuinfo``, read once per process), ``QUANTREG_HOST_CPU_FLAGS``
    not applied: what a compiled kernel's own dispatch (``cpuid``) sees.

    For a plugin's probe or status line naming the ISA path its native kernel will take: that path
    follows the hardware, while :func:`host_facts` (what decisions use) follows a simulation too.
    Plugin-facing (docs/writing-a-plugin.md, "A compiled kernel"); never raises (empty when unreadable).
    """
    return _real()[0]


def host_facts() -> HostFacts:
    """This host's facts (``/proc/cpuinfo`` read once per process; the override read per call)."""
    flags, vendor, model = _real()
    # empty means unset; "," names no flag: a settings problem, the real flags kept
    spec = settings.value(settings.HOST_CPU_FLAGS)
    simulated = bool(spec and spec.replace(",", " ").split())
    if simulated and spec is not None:
        flags = apply_override(flags, spec)
    return HostFacts(machine=platform.machine(), cpu_flags=flags, vendor=vendor, model_name=model,
                     cores=os.cpu_count() or 1, simulated=simulated)


def simulate(kind: str) -> dict[str, str]:
    """The environment that makes quantreg believe this host is of ``kind`` (``amx`` or ``avx2``).

    Only for tests and ``--host`` style what-ifs: ``avx2`` removes AVX-512 and AMX flags, ``amx``
    adds AMX's (quantreg then believes vLLM's own CPU MXFP4 kernel runs: never run that kernel so).
    """
    if kind == "avx2":  # what an AVX2-only host (AMD EPYC of that kind) lacks, as an Intel AMX host shows it
        hidden = (*AMX_FLAGS, *_AMX_EXTRA, *AVX512_FLAGS, *_AVX512_EXTRA, "avx_vnni")
        return {settings.HOST_CPU_FLAGS: ",".join(f"-{f}" for f in hidden)}
    if kind == "amx":
        return {settings.HOST_CPU_FLAGS: ",".join(f"+{f}" for f in (*AMX_FLAGS, *AVX512_FLAGS))}
    raise ValueError(f"unknown host kind '{kind}' (expected 'amx' or 'avx2')")
