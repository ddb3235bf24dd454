"""What a tuned measurement depends on (``tuned.pins``), recorded by ``quantreg tune`` and checked
against the running process wherever a tuned rule decides (no torch, no vLLM).

Why: a chain ordered by measurement on one host, for one vLLM / torch / plugin build, one kernel
binary and one layer shape, says nothing about another. TensorRT-LLM's autotuner cache is loaded
unchecked (a stale cache silently reused); quantreg names what changed instead. Each pinned
field is compared with this process's value; a mismatch is a :class:`Stale` naming the field
and both values. Lenient, the rule still decides as written and the decision, the audit trail
and the fingerprint carry the flag; strict, a vLLM start-up stops with one
``quantreg (strict):`` line (:mod:`quantreg.vllm.seam`).

Fields (every one optional: only what a table records is checked)::

    pins:
      cpu_model: "AMD EPYC 9V74 80-Core Processor"
      cpu_flags: [avx2, avx512bw, avx512f, avx512vl, ...]   # HostFacts.notable_flags (simulated flags count)
      bandwidth_gbs: 11.8      # single-thread read bandwidth, GB/s; stale beyond x4 either way
      vllm: 0.32.0+cpu
      torch: 2.13.0+cpu
      quantreg: 0.1.0
      plugins: {DISTRIBUTION: VERSION}            # the distribution of each measured method
      kernels: {METHOD: <sha256>}                  # the compiled extension files a measured method ships
      shape: {experts: 32, hidden: 2880, intermediate: 2880, top_k: 4}   # checked where a shape is known

A dense rule (``layer: attention | dense | lm_head``) pins the shape of its kind instead
(:func:`dense_shape`): ``{hidden, heads, kv_heads, head_dim}`` for attention, ``{hidden, experts}``
for the router (``dense``), ``{hidden, vocab}`` for the lm_head; read from config.json by ``plan``
and from vLLM's model config at start-up.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, Protocol

from .host import host_facts
from .installed import dist_version, installed_vllm_version
from .table.tuned import SHAPE_KEYS

if TYPE_CHECKING:
    from .methods import Method


class _PluginFacts(Protocol):
    """What pins read of a loaded plugin (``quantreg.plugins.PluginInfo``)."""

    @property
    def name(self) -> str: ...
    @property
    def distribution(self) -> str: ...
    @property
    def version(self) -> str: ...


class Registry(Protocol):
    """What pins read of the registry: its methods and the plugins that registered them.

    A structural type, not ``quantreg.registry.Registry``: the registry imports this module to check
    a tuned rule, so naming the class here would close an import circle (tests/test_layering.py).
    """

    @property
    def methods(self) -> Mapping[str, Method]: ...
    @property
    def plugin_infos(self) -> Sequence[_PluginFacts]: ...

BANDWIDTH_FACTOR = 4.0
"""Measured bandwidth is noisy on a shared host (the best of the scans moved 4x between two processes
on a 2-core host at load 19, others' traffic on the same memory bus): only a change beyond this
factor is called another memory system."""
BANDWIDTH_SCANS = 15
BANDWIDTH_BYTES = 64 << 20
"""Read per bandwidth sample: beyond any last-level cache of a host this runs on (so memory is measured)."""
COMPILED_SUFFIXES = (".so", ".pyd", ".dylib")
SHAPE_FIELDS = SHAPE_KEYS  # the table reader's list (quantreg.table.tuned): one list of shape fields
DENSE_SHAPE_FIELDS: Mapping[str, tuple[str, ...]] = {
    "attention": ("hidden", "heads", "kv_heads", "head_dim"),
    "dense": ("hidden", "experts"),
    "lm_head": ("hidden", "vocab"),
}
"""The shape fields each dense layer kind's weights depend on (GPT-OSS: qkv/o_proj, the router, the lm_head)."""
CONFIG_NAMES = {"hidden": "hidden_size", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
                "head_dim": "head_dim", "vocab": "vocab_size", "experts": "num_local_experts"}
"""config.json's (and vLLM's ``hf_config``'s) name of each dense shape field."""


def dense_shape(config: Mapping[str, Any], kind: str) -> dict[str, int] | None:
    """The shape a ``kind`` layer's weights have in a model of ``config`` (config.json's names), or ``None``.

    ``head_dim`` defaults to ``hidden_size / num_attention_heads`` as in transformers; ``None`` when
    a field the kind needs is missing or not a positive whole number (nothing to compare).
    """
    fields = DENSE_SHAPE_FIELDS.get(kind)
    if fields is None:
        return None
    values = {f: config.get(CONFIG_NAMES[f]) for f in fields}
    if "head_dim" in values and values["head_dim"] is None:
        heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
        if isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
            values["head_dim"] = hidden // heads
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values.values()):
        return None
    return {f: int(v) for f, v in values.items()}  # type: ignore[arg-type]


@dataclass(frozen=True)
class Stale:
    """One pinned field whose value in this process differs from what tune recorded."""

    field: str
    recorded: Any
    running: Any

    def text(self) -> str:
        return f"{self.field}: tuned with {_show(self.recorded)}, running {_show(self.running)}"


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return "none" if value is None else str(value)


@functools.cache
def read_bandwidth_gbs() -> float:
    """Single-thread read bandwidth in GB/s: the best of :data:`BANDWIDTH_SCANS` scans of :data:`BANDWIDTH_BYTES`.

    ``bytes.find`` of an absent byte is ``memchr`` (vectorised, read-bound); the buffer is
    written first (``b"\\x00" * n`` is a memset) so no shared zero page is measured. Once per
    process, ~50-100 ms.
    """
    buf = b"\x00" * BANDWIDTH_BYTES
    best = float("inf")
    for _ in range(BANDWIDTH_SCANS):
        start = time.perf_counter()
        buf.find(b"\x01")
        best = min(best, time.perf_counter() - start)
    return round(BANDWIDTH_BYTES / max(best, 1e-9) / 1e9, 1)


@functools.cache
def compiled_sha256(distribution: str, package: str = "") -> str | None:
    """sha256 over the compiled extension files ``distribution`` installs (name and bytes), ``None`` if none.

    The files are those its ``RECORD`` lists; an editable install (``pip install -e``) records none
    of its package's files, so then those under ``package``'s directory (the method's top-level
    package, where it is imported from), named relative to its parent as ``RECORD`` names them: the
    same names and the same hash under a wheel and an editable install of one build.
    """
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return None
    found = sorted((str(f), str(dist.locate_file(f))) for f in (dist.files or ()) if str(f).endswith(COMPILED_SUFFIXES))
    if not found and package:
        found = _package_compiled(package)
    if not found:
        return None
    digest = hashlib.sha256()
    for name, path in found:
        try:
            with open(path, "rb") as handle:
                digest.update(name.encode() + b"\0")
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
        except OSError:
            digest.update(name.encode() + b"\0missing")
    return digest.hexdigest()


def _package_compiled(package: str) -> list[tuple[str, str]]:
    """(name relative to the package's parent, path) of the compiled files under top-level ``package``."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    found = []
    for location in (spec.submodule_search_locations or ()) if spec is not None else ():
        parent = os.path.dirname(os.path.abspath(location))
        for folder, _, files in os.walk(location):
            found += [(os.path.relpath(os.path.join(folder, f), parent).replace(os.sep, "/"), os.path.join(folder, f))
                      for f in files if f.endswith(COMPILED_SUFFIXES)]
    return sorted(found)


def method_distribution(registry: Registry, method: str) -> tuple[str, str] | None:
    """(distribution, version) of the plugin that registered ``method``, ``None`` for vLLM's own or a table's."""
    found = registry.methods.get(method)
    if found is None:
        return None
    for info in registry.plugin_infos:
        if info.name == found.plugin and info.distribution:
            return info.distribution, info.version
    return None


def running_pins(registry: Registry, methods: Iterable[str], shape: Mapping[str, Any] | None = None,
                 fields: Iterable[str] | None = None) -> dict[str, Any]:
    """This process's value of every pinned field (only ``fields`` when given: the rest cost nothing)."""
    wanted = set(fields) if fields is not None else None

    def want(name: str) -> bool:
        return wanted is None or name in wanted

    facts = host_facts()
    pins: dict[str, Any] = {}
    if want("cpu_model"):
        pins["cpu_model"] = facts.model_name
    if want("cpu_flags"):
        pins["cpu_flags"] = facts.notable_flags
    if want("bandwidth_gbs"):
        pins["bandwidth_gbs"] = read_bandwidth_gbs()
    if want("vllm"):
        pins["vllm"] = installed_vllm_version()
    if want("torch"):
        pins["torch"] = dist_version("torch")
    if want("quantreg"):
        pins["quantreg"] = dist_version("quantreg")
    plugins: dict[str, str] = {}
    kernels: dict[str, str] = {}
    for method in methods:
        owner = method_distribution(registry, method)
        if owner is None:
            continue
        plugins[owner[0]] = owner[1]
        if want("kernels"):
            package = registry.methods[method].target.split(":", 1)[0].split(".", 1)[0]
            sha = compiled_sha256(owner[0], package)
            if sha is not None:
                kernels[method] = sha
    if want("plugins"):
        pins["plugins"] = plugins
    if want("kernels"):
        pins["kernels"] = kernels
    if shape is not None and want("shape"):
        pins["shape"] = {k: int(shape[k]) for k in SHAPE_FIELDS if k in shape}
    return pins


def stale_pins(recorded: Any, registry: Registry, shape: Mapping[str, Any] | None = None) -> list[Stale]:
    """Every field of ``recorded`` (a rule's ``tuned.pins``) that differs in this process.

    ``shape`` is the layer being decided (start-up, ``plan``); without one the shape is not
    checked (``explain`` and ``doctor`` name no checkpoint).

    Total: a field the table reader would refuse (:func:`quantreg.table.tuned.pin_problems`, the one
    check) is a :class:`Stale` saying it cannot be read, and so is a comparison that fails for any
    other reason: unexpected evidence is a finding (lenient: a WARNING; strict: no start), never
    an exception in a tool or at vLLM start-up.
    """
    from .table.tuned import pin_problems

    if not isinstance(recorded, Mapping):
        return [Stale("pins", _unreadable(pin_problems(recorded)[0][1]), "not compared")]
    invalid = dict(pin_problems(dict(recorded)))
    found = [Stale(str(name), _unreadable(message), "not compared") for name, message in invalid.items()]
    kernels = recorded.get("kernels") if "kernels" not in invalid else None
    methods = [str(m) for m in kernels] if isinstance(kernels, Mapping) else []
    checked = [f for f in recorded if f not in invalid and (f != "shape" or shape is not None)]
    try:
        running = running_pins(registry, methods, shape, fields=checked)
    except Exception as exc:  # this process's own facts could not be read: nothing compared, said
        return [*found, *(Stale(name, "recorded", f"unknown here ({type(exc).__name__})") for name in checked)]
    for name in checked:
        try:
            found += _compare(name, recorded[name], running.get(name))
        except Exception as exc:  # a value of a shape no check foresaw: a finding, not an exception
            found.append(Stale(name, _unreadable(f"{type(exc).__name__} comparing it"), "not compared"))
    return found


def _unreadable(message: str) -> str:
    return f"an unreadable value ({message})"


def _compare(name: str, want: Any, have: Any) -> list[Stale]:
    """The :class:`Stale` findings of one checked pinned field (``want`` recorded, ``have`` running)."""
    found: list[Stale] = []
    if name == "bandwidth_gbs":
        if isinstance(want, (int, float)) and want > 0 and isinstance(have, float) and have > 0 \
                and not 1 / BANDWIDTH_FACTOR <= have / want <= BANDWIDTH_FACTOR:
            found.append(Stale(name, f"{want} GB/s", f"{have} GB/s"))
    elif name == "plugins" and isinstance(want, Mapping):
        for dist, version in want.items():
            now = dist_version(str(dist))
            if str(version) != str(now):
                found.append(Stale(f"plugins.{dist}", version, now))
    elif name == "kernels" and isinstance(want, Mapping):
        for method, sha in want.items():
            now_sha = (have or {}).get(method)
            if sha != now_sha:
                found.append(Stale(f"kernels.{method}", str(sha)[:16], str(now_sha)[:16] if now_sha else None))
    elif name == "cpu_flags":
        if sorted(map(str, want or [])) != sorted(have or []):
            found.append(Stale(name, sorted(map(str, want or [])), sorted(have or [])))
    elif name == "shape" and isinstance(want, Mapping):
        current = have if isinstance(have, Mapping) else {}
        if any(k in want and k in current and want[k] != current[k] for k in SHAPE_FIELDS):
            found.append(Stale(name, dict(want), dict(current)))
    elif name in ("cpu_model", "vllm", "torch", "quantreg") and str(want) != str(have):
        found.append(Stale(name, want, have))
    return found
