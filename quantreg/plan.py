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
``explain``, ``doctor`` and the start-up line use too. Reading the files is
:mod:`quantreg.models.checkpoint_files` (``Checkpoint``, ``read_checkpoint``, re-exported here).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .keys import EXPERTS, LAYER_KINDS, Key, TokenRange
from .models.checkpoint_files import MX_BLOCK, UNQUANTIZED, Checkpoint, ranges, read_checkpoint
from .models.moe_config import EXPERT_COUNT_KEYS, text_config
from .problems import printable

__all__ = ["Checkpoint", "dense_plan", "device_plan", "plan", "plan_command", "quant_format_of", "read_checkpoint",
           "render"]

if TYPE_CHECKING:
    from .registry import Registry
    from .table.file import Rule

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
             f"[{ranges(ex.get('moe_layer_indices') or [])}], {ex.get('count')} experts, "
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
