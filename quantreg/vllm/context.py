"""What the seam knows about the layer being built: its key and the run's quantreg settings.

Everything here reads vLLM's own state (the quant config's name, the current VllmConfig,
the platform), so a key means exactly what vLLM means by it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..keys import Key
from ..problems import Problem, QuantregError

UNQUANTIZED = "unquantized"
ADDITIONAL_CONFIG_KEY = "quantreg"
ADDITIONAL_KEYS = ("config", "strict")


@dataclass(frozen=True)
class RunSettings:
    """``additional_config["quantreg"]``: extra tables (run layer) and strictness for this run."""

    config: tuple[str, ...] = ()
    strict: bool | None = None


def _current_vllm_config() -> Any:
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


UNKNOWN_MODEL = "unknown"


def current_model_type() -> str | None:
    """``hf_config.model_type`` of the vLLM config being built, or ``None`` outside one.

    The one reading of the model type: :func:`layer_key` puts it in the key, and a method built
    outside the seam (no :class:`~quantreg.methods.BuildContext`) can ask the same question here.
    """
    vllm_config = _current_vllm_config()
    model_config = getattr(vllm_config, "model_config", None)
    hf_config = getattr(model_config, "hf_config", None)
    model_type = getattr(hf_config, "model_type", None) if hf_config is not None else None
    return str(model_type) if model_type else None


def layer_key(quant_config: Any) -> Key:
    """(quant_config.get_name(), hf model_type, current_platform.device_type) for this layer."""
    from vllm.platforms import current_platform

    quant_format = str(quant_config.get_name()) if quant_config is not None else UNQUANTIZED
    model_type = current_model_type() or UNKNOWN_MODEL
    return Key(quant_format, model_type, str(current_platform.device_type))


def run_settings() -> RunSettings:
    """Read and check ``additional_config["quantreg"]`` of the current vLLM config."""
    vllm_config = _current_vllm_config()
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict) or ADDITIONAL_CONFIG_KEY not in extra:
        return RunSettings()
    return parse_run_settings(extra[ADDITIONAL_CONFIG_KEY])


def parse_run_settings(raw: Any) -> RunSettings:
    where = "vLLM additional_config"
    problems: list[Problem] = []
    if not isinstance(raw, dict):
        raise QuantregError([Problem(where, None, "quantreg", "expected a mapping with 'config' and/or 'strict'")])
    for k in raw:
        if k not in ADDITIONAL_KEYS:
            expected = ", ".join(ADDITIONAL_KEYS)
            problems.append(Problem(where, None, f"quantreg.{k}", f"unknown key (expected {expected})"))
    config = raw.get("config", [])
    if isinstance(config, str):
        config = [config]
    if not isinstance(config, list) or not all(isinstance(p, str) for p in config):
        problems.append(Problem(where, None, "quantreg.config", "expected a path or a list of paths"))
        config = []
    strict = raw.get("strict")
    if strict is not None and not isinstance(strict, bool):
        problems.append(Problem(where, None, "quantreg.strict", "expected true or false"))
        strict = None
    if problems:
        raise QuantregError(problems)
    return RunSettings(tuple(os.fspath(p) for p in config), strict)
