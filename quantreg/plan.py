"""``quantreg plan MODEL_DIR``: what every MoE layer of a local checkpoint gets per device, without vLLM running.

Why: an operator wants to know before starting a server (minutes, gigabytes) which method each
device will build, from which rule, how much memory the experts will take in that method's
layout, and whether anything on the host will change or break that plan. Everything comes from
files: ``config.json`` (model type, quant method, layer and expert counts, which layers are
MoE), the safetensors headers (expert tensor shapes and dtypes; only the 8-byte length and the
JSON header are read, no tensor data and no torch), and the registry's own ``resolve``.

The key's quant format is vLLM's name (``config.json`` says ``mxfp4``, the key says
``gpt_oss_mxfp4``): asked of vLLM's quant config classes when vLLM is importable
(:mod:`quantreg.vllm.quant_format`), else taken from :data:`QUANT_FORMAT_MAP`; the output's
``quant_format_source`` says which.

Expert bytes per method: each method holds the experts either as the checkpoint stores them
(``checkpoint``), packed MXFP4 (``packed``: 4-bit codes + one E8M0 byte per 32 values) or
dequantised to bf16 (``bf16``). :data:`EXPERT_LAYOUTS` declares this for the known methods; a
method object with an ``expert_layout`` attribute (a proposed :class:`~quantreg.methods.Method`
field) overrides it, so plugins can declare their own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .environment import module_available
from .keys import Key
from .methods import VLLM_METHOD
from .vllm_limits import VllmLimitation, all_limitations, vllm_backend_note

if TYPE_CHECKING:
    from .registry import Registry

UNQUANTIZED = "unquantized"

#: Used when vLLM is not importable: (checkpoint quant_method, model_type or "*") -> vLLM's name.
#: Read from vLLM 0.32: GptOssMxfp4Config.override_quantization_method
#: (model_executor/layers/quantization/mxfp4.py:129) and GptOssForCausalLMConfig
#: (model_executor/models/config.py:447) claim mxfp4 for gpt_oss; AutoAWQConfig / AutoGPTQConfig
#: report "auto_awq" / "auto_gptq" from get_name() (quantization/__init__.py:160, on CPU; CUDA
#: overrides may pick the *_marlin kernels instead). Anything else keeps its checkpoint name.
QUANT_FORMAT_MAP: dict[tuple[str, str], str] = {
    ("mxfp4", "gpt_oss"): "gpt_oss_mxfp4",
    ("gpt_oss_mxfp4", "*"): "gpt_oss_mxfp4",
    ("awq", "*"): "auto_awq",
    ("gptq", "*"): "auto_gptq",
}

#: How each known method holds the expert weights. ``checkpoint``: as stored (vLLM's own method
#: keeps MXFP4 packed, bf16 as bf16); ``packed``: MXFP4 codes + scales; ``bf16``: dequantised.
EXPERT_LAYOUTS: dict[str, str] = {
    VLLM_METHOD: "checkpoint",
    "mxfp4_reference": "packed",
    "hpu_mxfp4": "packed",
    "hpu_mxfp4_dequant": "bf16",
}

#: Bytes per element of safetensors dtypes.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "I16": 2,
               "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
#: Largest safetensors header read (the format's own recommended limit is 100 MB).
MAX_HEADER = 100 * 1024 * 1024
MX_BLOCK = 32
EXPERT_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward)\.experts\.(.+)$")
#: Config keys for the number of routed experts, in the order models use them.
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_top_k")
INTERMEDIATE_KEYS = ("moe_intermediate_size", "intermediate_size")
HPU_NATIVE_ENV = "HPU_MXFP4_NATIVE"


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


def _first(config: Mapping[str, Any], keys: Sequence[str]) -> Any:
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    return None


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of ``config`` (multimodal configs nest it in ``text_config``)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def moe_layer_indices(config: Mapping[str, Any]) -> list[int]:
    """Which decoder layers have routed experts, following each model family's config fields.

    * DeepSeek V2/V3/V4, Kimi: ``first_k_dense_replace`` dense layers first, then every
      ``moe_layer_freq``-th layer (``i >= k and i % freq == 0``);
    * Qwen2/3-MoE: ``mlp_only_layers`` are dense, others MoE when ``(i + 1) % decoder_sparse_step == 0``;
    * Llama 4: ``interleave_moe_layer_step`` (``moe_layers`` when given explicitly);
    * everything else with experts (GPT-OSS, Mixtral, ...): every layer.
    """
    cfg = text_config(config)
    n = int(cfg.get("num_hidden_layers") or 0)
    if not _first(cfg, EXPERT_COUNT_KEYS):
        return []
    if isinstance(cfg.get("moe_layers"), list):
        return sorted(int(i) for i in cfg["moe_layers"] if 0 <= int(i) < n)
    if "first_k_dense_replace" in cfg or "moe_layer_freq" in cfg:
        k = int(cfg.get("first_k_dense_replace") or 0)
        freq = max(1, int(cfg.get("moe_layer_freq") or 1))
        return [i for i in range(n) if i >= k and i % freq == 0]
    if "decoder_sparse_step" in cfg or "mlp_only_layers" in cfg:
        step = max(1, int(cfg.get("decoder_sparse_step") or 1))
        dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
        return [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    if "interleave_moe_layer_step" in cfg:
        step = max(1, int(cfg.get("interleave_moe_layer_step") or 1))
        return list(range(step - 1, n, step))
    return list(range(n))


def read_safetensors_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of a safetensors file: 8-byte little-endian length, then that many bytes of JSON."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than the 8-byte header length")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER:
            raise ValueError(f"header length {size} exceeds {MAX_HEADER} bytes")
        raw = f.read(size)
        if len(raw) != size:
            raise ValueError(f"header cut short ({len(raw)} of {size} bytes)")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            return sorted({directory / name for name in weight_map.values()})
        except (OSError, ValueError, AttributeError):
            pass
    return sorted(directory.glob("*.safetensors"))


def _tensor_bytes(info: Mapping[str, Any]) -> int:
    offsets = info.get("data_offsets")
    if isinstance(offsets, list) and len(offsets) == 2:
        return int(offsets[1]) - int(offsets[0])
    count = 1
    for d in info.get("shape", []):
        count *= int(d)
    return count * DTYPE_BYTES.get(str(info.get("dtype")), 0)


def expert_tensors(directory: Path, problems: list[str]) -> dict[int, dict[str, dict[str, Any]]]:
    """Per MoE layer index: expert tensor suffix -> ``{shape, dtype, bytes}`` from the headers."""
    layers: dict[int, dict[str, dict[str, Any]]] = {}
    for path in _safetensors_files(directory):
        if not path.is_file():
            problems.append(f"{path}: listed in model.safetensors.index.json but missing")
            continue
        try:
            header = read_safetensors_header(path)
        except (OSError, ValueError) as exc:
            problems.append(f"{path}: not a readable safetensors header: {exc}")
            continue
        for name, info in header.items():
            m = EXPERT_RE.search(name)
            if m is None or not isinstance(info, dict):
                continue
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = {
                "shape": [int(d) for d in info.get("shape", [])], "dtype": str(info.get("dtype")),
                "bytes": _tensor_bytes(info)}
    return layers


def read_checkpoint(directory: str | os.PathLike[str]) -> Checkpoint:
    """``config.json`` and the safetensors headers of ``directory``; faults become ``problems``."""
    root = Path(directory)
    ck = Checkpoint(str(root))
    path = root / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        ck.problems.append(f"{path}: missing (a Hugging Face checkpoint directory has a config.json)")
        return ck
    except json.JSONDecodeError as exc:
        ck.problems.append(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}")
        return ck
    except OSError as exc:
        ck.problems.append(f"{path}: cannot read: {exc.strerror or exc}")
        return ck
    if not isinstance(config, dict):
        ck.problems.append(f"{path}:1: expected a JSON object")
        return ck
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
    inter = _first(cfg, INTERMEDIATE_KEYS)
    tensors = expert_tensors(root, ck.problems)
    count = _first(cfg, EXPERT_COUNT_KEYS)
    ck.experts = {
        "count": int(count) if count is not None else None,
        "per_token": _first(cfg, TOP_K_KEYS),
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
    """The key's quant format and where that name came from (vLLM's classes or the mapping table)."""
    if ck.quant_method is None:
        return UNQUANTIZED, "no quantization_config in config.json: vLLM builds its unquantized method"
    quant = ck.config.get("quantization_config") or text_config(ck.config).get("quantization_config") or {}
    want_vllm = importlib.util.find_spec("vllm") is not None if use_vllm is None else use_vllm
    why_not = "vLLM is not importable here"
    if want_vllm:
        try:
            from .vllm.quant_format import vllm_quant_format

            return vllm_quant_format(dict(quant), {**text_config(ck.config), "model_type": ck.model_type})
        except ValueError as exc:
            ck.problems.append(f"{Path(ck.directory) / 'config.json'}: quantization_config.quant_method: {exc}")
            return ck.quant_method, f"checkpoint name kept: {exc}"
        except Exception as exc:  # a broken vLLM install must not break the plan
            why_not = f"vLLM could not be asked ({type(exc).__name__}: {exc})"
    elif use_vllm is False:
        why_not = "vLLM not consulted on request"
    for (method, model), name in QUANT_FORMAT_MAP.items():
        if method == ck.quant_method and model in ("*", ck.model_type):
            return name, f"quantreg.plan.QUANT_FORMAT_MAP ({why_not}): '{ck.quant_method}' -> '{name}'"
    return ck.quant_method, (f"quantreg.plan.QUANT_FORMAT_MAP ({why_not}): '{ck.quant_method}' not mapped, "
                             "assumed vLLM uses the checkpoint's name")


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
    declared = getattr(registry.methods.get(method), "expert_layout", None)
    if isinstance(declared, str) and declared:
        return declared
    return EXPERT_LAYOUTS.get(method)


def device_plan(registry: Registry, ck: Checkpoint, key: Key, limitations: Sequence[VllmLimitation],
                env: Mapping[str, str]) -> dict[str, Any]:
    decision = registry.resolve(key)
    warnings: list[str] = []
    if decision.fallback:
        warnings.append(f"{decision.fallback} (" + "; ".join(
            f"{s.method}: passed over: {s.reason}" for s in decision.passed_over) + ")")
    elif decision.passed_over:
        warnings.append("chain: " + "; ".join(f"{s.method}: passed over: {s.reason}" for s in decision.passed_over))
    if decision.keeps_vllm:
        note = vllm_backend_note(key, limitations)
        if note:
            warnings.append(note)
    if key.device == "hpu" and "mxfp4" in key.quant_format and module_available("vllm_gaudi") \
            and env.get(HPU_NATIVE_ENV) != "1":
        other = registry.resolve(Key(UNQUANTIZED, key.model_type, key.device))
        warnings.append(
            f"vllm-gaudi is installed and {HPU_NATIVE_ENV} is not 1: its models/gptoss_mxfp4.py drops the MXFP4 "
            f"quant config for gpt_oss, so vLLM forms the key {other.key} instead (decided {other.method} "
            f"[{other.source}]) and loads the experts dequantised to bf16; set {HPU_NATIVE_ENV}=1 to keep this key")
    layout = layout_of(decision.method, registry)
    expert_bytes: int | None = None
    if layout is None:
        warnings.append(f"method '{decision.method}' does not declare how it holds expert weights: "
                        "expert_bytes unknown")
    elif ck.moe_layers:
        per_layer = expert_bytes_per_layer(ck.experts, layout, key.quant_format)
        expert_bytes = per_layer * len(ck.moe_layers) if per_layer is not None else None
    else:
        expert_bytes = 0
    return {"method": decision.method, "rule": decision.source, "expert_bytes": expert_bytes,
            "warnings": warnings}


def plan(model_dir: str | os.PathLike[str], devices: Sequence[str], registry: Registry, *,
         use_vllm: bool | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The plan as a JSON-ready dict: ``key``, ``moe_layers``, ``experts``, ``devices``,
    ``quant_format_source``, ``problems`` (table faults, plugin faults and checkpoint faults)."""
    env = os.environ if env is None else env
    ck = read_checkpoint(model_dir)
    quant_format, source = quant_format_of(ck, use_vllm)
    limitations, faults = all_limitations(registry.plugins)
    ck.experts["bytes_per_layer"] = {layout: expert_bytes_per_layer(ck.experts, layout, quant_format)
                                     for layout in ("packed", "bf16")} if ck.moe_layers else {}
    per_device = {d: device_plan(registry, ck, Key(quant_format, ck.model_type, d), limitations, env)
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
        lines += [f"  warning {w}" for w in d["warnings"]]
    lines += [f"problem   {p}" for p in data["problems"]]
    return "\n".join(lines)


def plan_command(model_dir: str, devices: Sequence[str], config: Sequence[str], as_json: bool,
                 use_vllm: bool | None = None) -> int:
    """``quantreg plan``: print the plan; exit 1 when the checkpoint could not be read at all.

    ``use_vllm=None`` asks vLLM's quant config classes when vLLM is installed (imports vLLM and
    torch: a few seconds); ``False`` (a ``--no-vllm`` flag) uses the mapping table only.
    """
    from .environment import guess_device
    from .registry import Registry

    registry = Registry.build(config=config)
    data = plan(model_dir, list(devices) or [guess_device()], registry, use_vllm=use_vllm)
    print(json.dumps(data, indent=2, default=str) if as_json else render(data, model_dir))
    return 1 if not data["key"]["model_type"] or data["key"]["model_type"] == "unknown" else 0
