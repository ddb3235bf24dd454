"""``quantreg plan MODEL_DIR``: what every MoE layer of a local checkpoint gets per device, without vLLM running.

Why: an operator wants to know before starting a server (minutes, gigabytes) which method each
device will build, from which rule, how much memory the experts will take in that method's
layout, and whether anything on the host will change or break that plan. Everything comes from
files: ``config.json`` (model type, quant method, layer and expert counts, which layers are
MoE), the safetensors headers (expert tensor shapes and dtypes; only the 8-byte length and the
JSON header are read, no tensor data and no torch), and the registry's own ``resolve``.

The key's quant format is vLLM's name (``config.json`` says ``mxfp4``, the key says
``gpt_oss_mxfp4``): asked of vLLM's quant config classes when vLLM is importable
(:mod:`quantreg.vllm.quant_format`), else taken from its fallback table; the output's
``quant_format_source`` says which.

Expert bytes per method: each method holds the experts either as the checkpoint stores them
(``checkpoint``), packed MXFP4 (``packed``: 4-bit codes + one E8M0 byte per 32 values) or
dequantised to bf16 (``bf16``): each method declares which (:attr:`quantreg.Method.expert_layout`),
so core names no plugin's methods. What each device will do (decision, notes, plugins' findings
such as vllm-gaudi's MXFP4 switch) is :func:`quantreg.answer.answer`, the one computation
``explain``, ``doctor`` and the start-up line use too.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import jsonread
from .bounds import MAX_SIZE, shown
from .files import ReadRefused, inside, read_regular
from .keys import EXPERTS, LAYER_KINDS, Key, TokenRange
from .models.checkpoint import INDEX_NAME, checkpoint_index
from .models.moe_config import (
    EXPERT_COUNT_KEYS,
    INTERMEDIATE_KEYS,
    MAX_LAYERS,
    TOP_K_KEYS,
    first_of,
    moe_layer_indices,
    text_config,
)
from .problems import printable

if TYPE_CHECKING:
    from .registry import Registry
    from .table.file import Rule

UNQUANTIZED = "unquantized"

#: Bytes per element of safetensors dtypes.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "I16": 2,
               "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
#: Largest safetensors header read (the format's own recommended limit is 100 MB).
MAX_HEADER = 100 * 1024 * 1024
MAX_CONFIG = 16 * 1024 * 1024
"""Largest config.json read (real ones are a few KB)."""
MAX_EXPERTS = MAX_SIZE
MAX_COUNT = 1 << 40
MAX_BYTES_TOTAL = 1 << 50
MX_BLOCK = 32
EXPERT_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward)\.experts\.(.+)$")


@dataclass
class Checkpoint:
    """What the files say, before any decision."""

    directory: str
    config: dict[str, Any] = field(default_factory=dict)
    model_type: str = "unknown"
    quant_method: str | None = None
    moe_layers: list[int] = field(default_factory=list)
    experts: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def read_safetensors_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of a safetensors file: 8-byte little-endian length, then that many bytes of JSON.

    Read through :mod:`quantreg.files` (regular files only, never blocking) and
    :mod:`quantreg.jsonread` (bounded, finite); ``ValueError`` says what is wrong.
    """
    try:
        head = read_regular(path, 8, head=True, expected="a safetensors file")
        if len(head) != 8:
            raise ValueError("shorter than the 8-byte header length")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER:
            raise ValueError(f"header length {size} exceeds {MAX_HEADER} bytes")
        raw = read_regular(path, 8 + size, head=True, expected="a safetensors file")[8:]
    except ReadRefused as exc:
        raise ValueError(str(exc)) from None
    if len(raw) != size:
        raise ValueError(f"header cut short ({len(raw)} of {size} bytes)")
    try:
        header = jsonread.loads(raw, max_bytes=MAX_HEADER)
    except jsonread.JsonRefused as exc:
        raise ValueError(f"header: {exc.message}") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header


def _safetensors_files(directory: Path, problems: list[str]) -> list[Path]:
    """The shards the index names (never outside ``directory``), else every ``*.safetensors`` there."""
    index = directory / INDEX_NAME
    weight_map, found = checkpoint_index(directory)
    problems += found
    if weight_map is not None:
        shards: set[Path] = set()
        for name in set(weight_map.values()):
            target = inside(directory, name)
            if target is None:
                problems.append(f"{index}: weight_map: shard {printable(name[:200])!r} is not a file name inside "
                                "the checkpoint; not read")
            else:
                shards.add(Path(target))
        return sorted(shards)
    return sorted(directory.glob("*.safetensors"))


def _count(value: Any, low: int = 0, high: int = MAX_COUNT) -> int | None:
    """``value`` if it is an integer (not a boolean) in ``[low, high]``, else ``None``."""
    return value if type(value) is int and low <= value <= high else None


def _tensor_info(info: Any) -> dict[str, Any] | None:
    """``{shape, dtype, bytes}`` of a header entry, or ``None`` when it is not what safetensors writes."""
    if not isinstance(info, dict):
        return None
    shape = info.get("shape")
    dtype = info.get("dtype")
    offsets = info.get("data_offsets")
    if not (isinstance(shape, list) and len(shape) <= 8 and all(_count(d) is not None for d in shape)):
        return None
    if not isinstance(dtype, str):
        return None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o, 0, MAX_BYTES_TOTAL) is not None
                                                                   for o in offsets) and offsets[0] <= offsets[1]):
        return None
    return {"shape": list(shape), "dtype": dtype, "bytes": offsets[1] - offsets[0]}


def expert_tensors(directory: Path, problems: list[str]) -> dict[int, dict[str, dict[str, Any]]]:
    """Per MoE layer index: expert tensor suffix -> ``{shape, dtype, bytes}`` from the headers."""
    layers: dict[int, dict[str, dict[str, Any]]] = {}
    for path in _safetensors_files(directory, problems):
        if not path.is_file():
            problems.append(f"{path}: listed in model.safetensors.index.json but missing")
            continue
        try:
            header = read_safetensors_header(path)
        except (OSError, ValueError) as exc:
            problems.append(f"{path}: not a readable safetensors header: {exc}")
            continue
        bad = 0
        for name, info in header.items():
            m = EXPERT_RE.search(name)
            if m is None:
                continue
            tensor = _tensor_info(info)
            layer = int(m.group(1)) if len(m.group(1)) <= 6 else None
            if tensor is None or layer is None:
                bad += 1
                if bad <= 3:
                    problems.append(f"{path}: {printable(name[:200])}: expected shape (a list of non-negative "
                                    "integers), dtype (a string) and data_offsets ([start, end], 0 <= start <= end); "
                                    "ignored")
                continue
            layers.setdefault(layer, {})[m.group(2)] = tensor
        if bad > 3:
            problems.append(f"{path}: {bad - 3} more malformed expert tensor entries ignored")
    return layers


#: Fields of config.json quantreg reads, with the integer range vLLM's model code would accept.
INT_FIELDS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (0, MAX_LAYERS), "hidden_size": (1, MAX_SIZE), "intermediate_size": (1, MAX_SIZE),
    "moe_intermediate_size": (1, MAX_SIZE), "first_k_dense_replace": (0, MAX_LAYERS),
    # the dense layers' sizes (quantreg.pins.dense_shape: tune --layers, plan's shape pins, the dense seam)
    "vocab_size": (1, MAX_SIZE), "num_attention_heads": (1, MAX_SIZE), "num_key_value_heads": (1, MAX_SIZE),
    "head_dim": (1, MAX_SIZE),
    "moe_layer_freq": (1, MAX_LAYERS), "decoder_sparse_step": (1, MAX_LAYERS),
    "interleave_moe_layer_step": (1, MAX_LAYERS),
    **{k: (1, MAX_EXPERTS) for k in EXPERT_COUNT_KEYS}, **{k: (1, MAX_EXPERTS) for k in TOP_K_KEYS},
}
LIST_FIELDS = ("mlp_only_layers", "moe_layers")
STR_FIELDS = ("model_type",)
DICT_FIELDS = ("quantization_config", "text_config")


def checked_config(config: dict[str, Any], where: str, problems: list[str], inner: bool = False) -> dict[str, Any]:
    """``config`` without the fields quantreg reads that are not what vLLM would accept, each a located problem.

    Why drop instead of fail: ``plan`` must still say what it can (the model type, the decision)
    when one number is a string, infinite, a boolean or 10^12; the problem names the field.
    """
    out = dict(config)
    prefix = "text_config." if inner else ""
    for key, (low, high) in INT_FIELDS.items():
        if key in out and out[key] is not None and _count(out[key], low, high) is None:
            problems.append(f"{where}: {prefix}{key}: expected an integer from {low} to {high}, got "
                            f"{shown(out[key])}; ignored")
            del out[key]
    for key in LIST_FIELDS:
        if key in out and out[key] is not None and not (
                isinstance(out[key], list) and len(out[key]) <= MAX_LAYERS
                and all(_count(i, 0, MAX_LAYERS) is not None for i in out[key])):
            problems.append(f"{where}: {prefix}{key}: expected a list of layer numbers (0 to {MAX_LAYERS}); ignored")
            del out[key]
    for key in STR_FIELDS:
        if key in out and out[key] is not None and not (isinstance(out[key], str) and 0 < len(out[key]) <= 200):
            problems.append(f"{where}: {prefix}{key}: expected a name (a string); ignored")
            del out[key]
    for key in DICT_FIELDS:
        if key in out and out[key] is not None and not isinstance(out[key], dict):
            problems.append(f"{where}: {prefix}{key}: expected a JSON object; ignored")
            del out[key]
    quant = out.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") is not None and not isinstance(quant["quant_method"], str):
        problems.append(f"{where}: {prefix}quantization_config.quant_method: expected a name (a string); ignored")
        out["quantization_config"] = {k: v for k, v in quant.items() if k != "quant_method"}
    if not inner and isinstance(out.get("text_config"), dict):
        out["text_config"] = checked_config(out["text_config"], where, problems, inner=True)
    return out


def read_checkpoint(directory: str | os.PathLike[str]) -> Checkpoint:
    """``config.json`` and the safetensors headers of ``directory``; faults become ``problems``."""
    root = Path(directory)
    ck = Checkpoint(str(root))
    path = root / "config.json"
    try:
        config = jsonread.loads(read_regular(path, MAX_CONFIG, expected="a JSON file"))
    except ReadRefused as exc:
        if str(exc) == "no such file":
            ck.problems.append(f"{path}: missing (a Hugging Face checkpoint directory has a config.json)")
        else:
            ck.problems.append(f"{path}: {exc}")
        return ck
    except jsonread.JsonRefused as exc:
        ck.problems.append(f"{path}:{exc.line or 1}: {exc.message}")
        return ck
    if not isinstance(config, dict):
        ck.problems.append(f"{path}:1: expected a JSON object")
        return ck
    config = checked_config(config, str(path), ck.problems)
    ck.config = config
    cfg = text_config(config)
    ck.model_type = str(config.get("model_type") or cfg.get("model_type") or "unknown")
    if ck.model_type == "unknown":
        ck.problems.append(f"{path}: model_type: missing (the key's model type is unknown)")
    quant = config.get("quantization_config") or cfg.get("quantization_config")
    if isinstance(quant, dict):
        ck.quant_method = str(quant.get("quant_method")) if quant.get("quant_method") else None
        if ck.quant_method is None:
            ck.problems.append(f"{path}: quantization_config.quant_method: missing")
    ck.moe_layers = moe_layer_indices(config)
    hidden = cfg.get("hidden_size")
    inter = first_of(cfg, INTERMEDIATE_KEYS)
    tensors = expert_tensors(root, ck.problems)
    count = first_of(cfg, EXPERT_COUNT_KEYS)
    ck.experts = {
        "count": int(count) if count is not None else None,
        "per_token": first_of(cfg, TOP_K_KEYS),
        "hidden_size": hidden,
        "intermediate_size": inter,
        "moe_layer_indices": ck.moe_layers,
        "source": "config.json",
        "tensors": {},
    }
    if tensors:
        first = min(tensors)
        ck.experts["tensors"] = {k: {"shape": v["shape"], "dtype": v["dtype"]} for k, v in
                                 sorted(tensors[first].items())}
        ck.experts["source"] = "config.json + safetensors headers"
        ck.experts["checkpoint_bytes_per_layer"] = sum(v["bytes"] for v in tensors[first].values())
        ck.experts["checkpoint_bytes"] = sum(v["bytes"] for layer in tensors.values() for v in layer.values())
        found = sorted(tensors)
        if ck.moe_layers and found != ck.moe_layers:
            ck.problems.append(f"{path}: config.json implies MoE layers {_ranges(ck.moe_layers)} but the "
                               f"safetensors files hold expert tensors for layers {_ranges(found)}")
    if ck.moe_layers and (count is None or hidden is None or inter is None):
        ck.problems.append(f"{path}: hidden_size / intermediate_size / expert count incomplete: "
                           "expert bytes cannot be computed")
    return ck


def _ranges(ids: Sequence[int]) -> str:
    if not ids:
        return "none"
    if list(ids) == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}..{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return ",".join(map(str, ids))


def quant_format_of(ck: Checkpoint, use_vllm: bool | None = None) -> tuple[str, str]:
    """The key's quant format and where that name came from (vLLM's classes or the fallback table).

    vLLM's names are vLLM knowledge: :mod:`quantreg.vllm.quant_format` holds them (imported here,
    lazily: it imports vLLM only when asked to).
    """
    if ck.quant_method is None:
        return UNQUANTIZED, "no quantization_config in config.json: vLLM builds its unquantized method"
    from .vllm.quant_format import key_quant_format

    quant = ck.config.get("quantization_config") or text_config(ck.config).get("quantization_config") or {}
    name, source, problem = key_quant_format(dict(quant), {**text_config(ck.config), "model_type": ck.model_type},
                                             use_vllm)
    if problem:
        ck.problems.append(f"{Path(ck.directory) / 'config.json'}: quantization_config.quant_method: {problem}")
    return name, source


def expert_bytes_per_layer(experts: Mapping[str, Any], layout: str, quant_format: str) -> int | None:
    """Bytes one MoE layer's experts take in ``layout`` (before any padding a kernel adds).

    GPT-OSS style gated experts: w13 ``[E, 2I, H]`` and w2 ``[E, H, I]``, biases (bf16)
    counted when the checkpoint has them. ``checkpoint`` uses the safetensors sizes when known.
    """
    if layout == "checkpoint" and experts.get("checkpoint_bytes_per_layer"):
        return int(experts["checkpoint_bytes_per_layer"])
    e, h, i = experts.get("count"), experts.get("hidden_size"), experts.get("intermediate_size")
    if not (e and h and i):
        return None
    e, h, i = int(e), int(h), int(i)
    weights = e * (2 * i * h + h * i)
    tensors = experts.get("tensors") or {}
    bias = e * (2 * i + h) * 2 if any(k.endswith("bias") for k in tensors) or not tensors else 0
    if layout == "checkpoint":
        layout = "packed" if "mxfp4" in quant_format else "bf16"
    if layout == "packed":
        return weights // 2 + weights // MX_BLOCK + bias
    if layout == "bf16":
        return weights * 2 + bias
    return None


def layout_of(method: str, registry: Registry) -> str | None:
    """How ``method`` holds the experts, as its registration declares (:attr:`Method.expert_layout`)."""
    m = registry.methods.get(method)
    return m.expert_layout if m is not None else None


def device_plan(registry: Registry, ck: Checkpoint, key: Key) -> dict[str, Any]:
    """One device's part of the plan, from the one answer every tool gives (:func:`quantreg.answer.answer`)."""
    from .answer import answer
    from .vllm.names import device_warning, known_names

    ans = answer(registry, key)
    decision = ans.decision
    warnings = ans.warnings
    named = device_warning(key.device, known_names(registry)[1])  # --device gpu: vLLM says cuda
    if named:
        warnings.insert(0, named)
    # the rules for this key from two sources (two plugins, or the user's table over a plugin's): both named
    winner = decision.rule
    warnings += [c for c in registry.collisions()
                 if winner is not None and f"rule {winner.location} " in c and winner.match.matches(key)]
    shape = {"experts": ck.experts.get("count"), "hidden": ck.experts.get("hidden_size"),
             "intermediate": ck.experts.get("intermediate_size"), "top_k": ck.experts.get("per_token")}
    tuned: dict[int, tuple[Rule, TokenRange]] = {}  # by identity (a Rule holds mappings: not hashable)
    for side in decision.sides:  # every side's rule, a split's second side too; once per rule
        if side.decision.rule is not None and side.decision.rule.tuned is not None:
            tuned.setdefault(id(side.decision.rule), (side.decision.rule, side.tokens))
    if all(isinstance(v, int) for v in shape.values()):  # the checkpoint's shape vs tune's
        for rule, tokens in tuned.values():
            where = f" (tokens{tokens})" if decision.split else ""
            warnings += [f"tuned rule is stale{where}: {s.text()}"
                         for s in registry.stale_evidence(rule, shape) if s.field == "shape"]
    expert_bytes = _expert_bytes(registry, ck, key, decision.method, warnings)
    data = {"method": decision.method, "rule": decision.source, "expert_bytes": expert_bytes,
            "warnings": warnings, **ans.to_json()}
    if decision.split:  # tokens: rules: every side, the bytes each holds, and the copy a shared load may cost
        sides = [{"tokens": str(s.tokens), "method": s.decision.method, "rule": s.decision.source,
                  "expert_bytes": _expert_bytes(registry, ck, key, s.decision.method, warnings)}
                 for s in decision.split]
        data["split"] = sides
        data["method"] = decision.methods_text()
        data["rule"] = ", ".join(str(s["rule"]) for s in sides)
        per_side = [s["expert_bytes"] for s in sides]
        data["expert_bytes"] = sum(per_side) if decision.is_split and None not in per_side else (
            per_side[0] if not decision.is_split else None)
        packed = ck.experts.get("checkpoint_bytes_per_layer")
        if decision.is_split and isinstance(packed, int):
            # a side that must not share the loaded weights (another side repacks them in place) gets a copy
            data["split_copy_bytes_max"] = packed * len(ck.moe_layers) * (len(sides) - 1)
            data["split_note"] = (
                f"split per forward token count: experts hold every side's weights; a side that cannot share the "
                f"loaded weights (another side repacks them in place) gets its own copy: at most "
                f"{_human(data['split_copy_bytes_max'])} more over {len(ck.moe_layers)} layer(s) (logged at load), "
                "and one layer's packed experts as a temporary copy while loading")
    dense = dense_plan(registry, key, ck.config)
    if dense:  # only where a table has dense rules: every other plan keeps its JSON
        data["dense"] = dense
    return data


def _expert_bytes(registry: Registry, ck: Checkpoint, key: Key, method: str, warnings: list[str]) -> int | None:
    """Bytes of expert weights ``method`` holds over the checkpoint's MoE layers (``None``: unknown, said once)."""
    layout = layout_of(method, registry)
    if layout is None:
        warning = (f"method '{method}' does not declare how it holds expert weights "
                   "(Method.expert_layout): expert_bytes unknown")
        if warning not in warnings:
            warnings.append(warning)
        return None
    if not ck.moe_layers:
        return 0
    per_layer = expert_bytes_per_layer(ck.experts, layout, key.quant_format)
    return per_layer * len(ck.moe_layers) if per_layer is not None else None


def dense_plan(registry: Registry, key: Key, config: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The decision for each dense layer kind of ``key`` (issue 30), when any rule names a dense kind.

    A tuned dense rule's ``shape`` pin is compared with the kind's sizes in ``config`` (config.json):
    a differing shape is a ``stale`` entry (only then: every other plan keeps its JSON)."""
    if not any(r.match.layer is not None and set(r.match.layers) - {EXPERTS} for r in registry.index.rules):
        return {}
    from .pins import dense_shape

    out: dict[str, dict[str, Any]] = {}
    for kind in LAYER_KINDS[1:]:
        decision = registry.resolve(key.of_layer(kind))
        out[kind] = {"method": decision.method, "rule": decision.source}
        shape = dense_shape(config, kind) if config and decision.rule is not None and decision.rule.tuned else None
        if shape is not None and decision.rule is not None:
            stale = [s.text() for s in registry.stale_evidence(decision.rule, shape) if s.field == "shape"]
            if stale:
                out[kind]["stale"] = stale
    return out


def plan(model_dir: str | os.PathLike[str], devices: Sequence[str], registry: Registry, *,
         use_vllm: bool | None = None) -> dict[str, Any]:
    """The plan as a JSON-ready dict: ``key``, ``moe_layers``, ``experts``, ``devices``,
    ``quant_format_source``, ``problems`` (table faults, plugin faults and checkpoint faults)."""
    ck = read_checkpoint(model_dir)
    quant_format, source = quant_format_of(ck, use_vllm)
    _, faults = registry.limitations()
    ck.experts["bytes_per_layer"] = {layout: expert_bytes_per_layer(ck.experts, layout, quant_format)
                                     for layout in ("packed", "bf16")} if ck.moe_layers else {}
    per_device = {d: device_plan(registry, ck, Key(quant_format, ck.model_type, d))
                  for d in devices}
    if not ck.moe_layers and ck.config:
        ck.problems.append(f"{Path(ck.directory) / 'config.json'}: no routed experts (none of "
                           f"{', '.join(EXPERT_COUNT_KEYS)}): the model has no MoE layers for quantreg to decide")
    return {
        "key": {"quant_format": quant_format, "model_type": ck.model_type},
        "moe_layers": len(ck.moe_layers),
        "experts": ck.experts,
        "devices": per_device,
        "quant_format_source": source,
        "problems": [*map(str, registry.problems), *map(str, registry.failures), *faults, *ck.problems],
    }


def _human(n: int | None) -> str:
    if n is None:
        return "unknown"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{n} B"
        size /= 1024
    return f"{n} B"


def render(data: Mapping[str, Any], model_dir: str) -> str:
    """Text form of :func:`plan`'s dict."""
    key = data["key"]
    ex = data["experts"]
    lines = [f"model     {model_dir}",
             f"key       ({key['quant_format']}, {key['model_type']}, <device>)",
             f"format    {data['quant_format_source']}",
             f"moe       {data['moe_layers']} MoE layer(s) "
             f"[{_ranges(ex.get('moe_layer_indices') or [])}], {ex.get('count')} experts, "
             f"top-{ex.get('per_token')}, hidden {ex.get('hidden_size')}, intermediate {ex.get('intermediate_size')} "
             f"({ex.get('source')})"]
    for name, t in (ex.get("tensors") or {}).items():
        lines.append(f"  tensor  experts.{name} {t['dtype']} {t['shape']}")
    for device, d in data["devices"].items():
        lines.append(f"{device:<9} {d['method']} [{d['rule']}]  experts hold {_human(d['expert_bytes'])}")
        lines += [f"  split   {d['split_note']}"] if d.get("split_note") else []
        lines += [f"  warning {w}" for w in d["warnings"]]
        for kind, v in d.get("dense", {}).items():
            lines.append(f"  {kind:<9} {v['method']} [{v['rule']}]")
            lines += [f"  warning {kind} tuned rule is stale: {t}" for t in v.get("stale", ())]
    lines += [f"problem   {p['text'] if isinstance(p, Mapping) else p}" for p in data["problems"]]
    return "\n".join(printable(line) for line in lines)  # paths and values from outside: one line each, encodable


def plan_command(model_dir: str, devices: Sequence[str], config: Sequence[str], as_json: bool,
                 use_vllm: bool | None = None,
                 envelope: Callable[[Any, Sequence[object]], Mapping[str, Any]] | None = None) -> int:
    """``quantreg plan``: print the plan; exit 1 when the checkpoint could not be read at all, or when
    strict mode is in force and a vLLM start-up with these tables would refuse (one line on stderr).

    ``use_vllm=None`` asks vLLM's quant config classes when vLLM is installed (imports vLLM and
    torch: a few seconds); ``False`` (a ``--no-vllm`` flag) uses the mapping table only.
    """
    from .host import guess_device
    from .registry import Registry

    registry = Registry.build(config=config)
    data = plan(model_dir, list(devices) or [guess_device()], registry, use_vllm=use_vllm)
    unreadable = not data["key"]["model_type"] or data["key"]["model_type"] == "unknown"
    if envelope is not None:  # the CLI's --json envelope: problems as objects, left_out, vllm_would_refuse
        faults = [*registry.problems, *registry.failures]  # plan() lists these first, as text: give the objects
        data = {**data, **envelope(registry, [*faults, *data["problems"][len(faults):]])}
    if as_json:
        print(json.dumps(data, indent=2, default=str))
    elif unreadable:  # no checkpoint to describe: only why (no "0 MoE layer(s) [none], None experts")
        print("\n".join(printable(f"problem   {p['text'] if isinstance(p, Mapping) else p}") for p in data["problems"]))
    else:
        print(render(data, model_dir))
    refusal = data.get("vllm_would_refuse")  # strict and a fault: say so and exit 1, as explain does
    if refusal:
        print(refusal, file=sys.stderr)
    return 1 if unreadable or refusal else 0
