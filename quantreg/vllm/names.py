"""The names vLLM puts in a key, so a name vLLM never uses is flagged instead of answered silently.

Why: ``quantreg explain mxfp4 gpt_oss cpu`` (what ``config.json`` says) or device ``gpu`` answer from
the default rule, yet vLLM's key is ``(gpt_oss_mxfp4, gpt_oss, cuda)``: a rule written with those
names never matches. This module holds static lists (no vLLM import): the quant formats of vLLM's
registry of quantization methods (``vllm.model_executor.layers.quantization.QUANTIZATION_METHODS``,
vLLM 0.32; ``tests/test_vllm_names.py`` compares the list with the installed vLLM) plus
``unquantized``, and the device types vLLM's platforms report (``current_platform.device_type``:
``cpu``, ``cuda`` (ROCm too), ``xpu``, ``tpu``; ``hpu`` from vllm-gaudi's platform plugin). Plugins
add theirs: every format and device any loaded table or method names counts as known.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ..keys import Key
from ..problems import did_you_mean, printable

if TYPE_CHECKING:
    from ..registry import Registry
    from ..table.file import Tier

#: vLLM 0.32's QUANTIZATION_METHODS, plus the seam's name for a layer without a quant config.
VLLM_QUANT_FORMATS = (
    "auto_awq", "auto_gptq", "awq", "awq_marlin", "compressed-tensors", "deepseek_v4_fp8", "experts_int8",
    "fbgemm_fp8", "fp8", "fp8_per_block", "fp8_per_channel", "fp8_per_tensor", "fp_quant", "gpt_oss_mxfp4",
    "gptq", "gptq_marlin", "humming", "inc", "int8_per_channel_weight_only", "modelopt", "modelopt_fp4",
    "modelopt_mixed", "modelopt_mxfp8", "moe_wna16", "mxfp4", "mxfp8", "nvfp4_per_token", "online", "quark",
    "torchao", "unquantized",
)
#: ``current_platform.device_type`` of vLLM's platforms and of the hardware plugins quantreg knows.
VLLM_DEVICES = ("cpu", "cuda", "xpu", "tpu", "hpu", "npu")
#: Everyday names for a device that vLLM spells otherwise.
DEVICE_ALIASES = {"gpu": "cuda", "nvidia": "cuda", "rocm": "cuda", "amd": "cuda", "hip": "cuda", "gaudi": "hpu",
                  "habana": "hpu", "intel_gpu": "xpu", "ascend": "npu"}
#: (checkpoint quant_method, model_type) that vLLM keys under another name (see quantreg.plan's map).
RENAMED_FORMATS = {("mxfp4", "gpt_oss"): "gpt_oss_mxfp4"}
PLAN_HINT = "`quantreg plan MODEL_DIR` prints a checkpoint's exact key"


def format_warning(quant_format: str, model_type: str | None, known: Iterable[str] = ()) -> str | None:
    """Why ``quant_format`` (for ``model_type``, if given) is not what vLLM's key would hold, else ``None``."""
    renamed = RENAMED_FORMATS.get((quant_format, model_type or ""))
    if renamed is not None:
        return (f"vLLM keys {printable(model_type or '')} checkpoints with quant_method '{printable(quant_format)}' "
                f"as '{renamed}', not '{printable(quant_format)}'; did you mean '{renamed}'? ({PLAN_HINT})")
    choices = sorted({*VLLM_QUANT_FORMATS, *known})
    if quant_format in choices or quant_format == "*":
        return None
    return (f"'{printable(quant_format)}' is no quant format name vLLM uses{did_you_mean(quant_format, choices)} "
            f"({PLAN_HINT})")


def device_warning(device: str, known: Iterable[str] = ()) -> str | None:
    """Why ``device`` is not a device type vLLM reports, else ``None``."""
    choices = sorted({*VLLM_DEVICES, *known})
    if device in choices or device == "*":
        return None
    alias = DEVICE_ALIASES.get(device.lower())
    hint = f"; did you mean '{alias}'?" if alias else did_you_mean(device, choices)
    return f"'{printable(device)}' is no device name vLLM uses{hint} ({PLAN_HINT})"


def key_warnings(key: Key, formats: Iterable[str] = (), devices: Iterable[str] = ()) -> list[str]:
    """Warnings for each part of ``key`` vLLM would never put there (formats/devices: the tables' and plugins')."""
    found = [format_warning(key.quant_format, key.model_type, formats), device_warning(key.device, devices)]
    return [w for w in found if w]


def known_names(registry: Registry, tiers: Sequence[Tier] | None = None) -> tuple[set[str], set[str]]:
    """Quant formats and devices the loaded tables (of ``tiers``, default all) and methods name:
    the names a plugin's platform may use that vLLM's own lists do not hold."""
    formats: set[str] = set()
    devices = {d for m in registry.methods.values() for d in m.devices}
    for table in registry.tables:
        if tiers is not None and table.tier not in tiers:
            continue
        for rule in table.rules:
            formats.update(rule.match.quant_format or ())
            devices.update(rule.match.device or ())
    return formats, devices
