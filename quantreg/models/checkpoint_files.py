"""A local checkpoint as its files describe it, before any decision and without reading tensor data.

``config.json`` (model type, quant method, layer and expert counts, which layers are MoE), each field
checked against the range vLLM's model code would accept, and the safetensors headers (only the 8-byte
length and the JSON header: the experts' shapes and dtypes per MoE layer; no torch). ``quantreg plan``
answers from it; ``quantreg tune`` reads a checkpoint's key and shapes through it. Split out of
``plan.py`` (issue 47): reading the files is one idea, answering per device another.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import jsonread
from ..bounds import MAX_SIZE, shown
from ..files import ReadRefused, inside, read_regular
from ..models.checkpoint import INDEX_NAME, checkpoint_index
from ..problems import printable
from .moe_config import (
    EXPERT_COUNT_KEYS,
    INTERMEDIATE_KEYS,
    MAX_LAYERS,
    TOP_K_KEYS,
    first_of,
    moe_layer_indices,
    text_config,
)

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
            ck.problems.append(f"{path}: config.json implies MoE layers {ranges(ck.moe_layers)} but the "
                               f"safetensors files hold expert tensors for layers {ranges(found)}")
    if ck.moe_layers and (count is None or hidden is None or inter is None):
        ck.problems.append(f"{path}: hidden_size / intermediate_size / expert count incomplete: "
                           "expert bytes cannot be computed")
    return ck


def ranges(ids: Sequence[int]) -> str:
    """Layer indices as text: ``0..23`` when contiguous, else ``1,3,5`` (``none`` when empty)."""
    if not ids:
        return "none"
    if list(ids) == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}..{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return ",".join(map(str, ids))
