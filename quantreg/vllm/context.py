"""What the seam knows about the layer being built: its key and the run's quantreg settings.

Everything here reads vLLM's own state (the quant config's name, the current VllmConfig,
the platform), so a key means exactly what vLLM means by it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .. import settings
from ..keys import Key
from ..problems import Problem, QuantregError, printable, quantreg_logger, type_name

logger = quantreg_logger("vllm.quantreg")

UNQUANTIZED = "unquantized"
ADDITIONAL_CONFIG_KEY = "quantreg"
ADDITIONAL_KEYS = ("config", "strict")


@dataclass(frozen=True)
class RunSettings:
    """``additional_config["quantreg"]``: extra tables (run tier) and strictness for this run."""

    config: tuple[str, ...] = ()
    strict: bool | None = None
    problems: tuple[Problem, ...] = ()


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
    """``additional_config["quantreg"]`` as settings; never raises: each bad piece is a located problem.

    Why never raise: a run setting is optional, so in a lenient start a typo'd key, a path where a
    list belongs or ``"strict": "false"`` must cost one WARNING, not quantreg (vLLM used to exit 1
    in EngineCore with a "(strict)" line nobody asked for). Only the bad piece is dropped: valid
    table paths in a list with a bad entry are kept. ``strict`` is strict only for ``true`` (or
    a true word as a string, warned about); ``"false"``/``"no"``/... are false.
    """
    where = "vLLM additional_config"
    problems: list[Problem] = []
    if not isinstance(raw, dict):
        problems.append(Problem(where, None, "quantreg", f"expected a mapping with 'config' and/or 'strict', "
                                                         f"got {type_name(raw)}; ignored"))
        return RunSettings(problems=tuple(problems))
    for k in raw:
        if k not in ADDITIONAL_KEYS:
            expected = ", ".join(ADDITIONAL_KEYS)
            problems.append(Problem(where, None, f"quantreg.{printable(str(k))[:80]}",
                                    f"unknown key (expected {expected}); ignored"))
    config = raw.get("config", [])
    if isinstance(config, (str, os.PathLike)):
        config = [config]
    paths: list[str] = []
    if not isinstance(config, (list, tuple)):
        problems.append(Problem(where, None, "quantreg.config",
                                f"expected a path or a list of paths, got {type_name(config)}; ignored"))
        config = []
    for i, entry in enumerate(config):
        if isinstance(entry, (str, os.PathLike)) and os.fspath(entry).strip() and "\0" not in os.fspath(entry):
            paths.append(str(os.fspath(entry)))
        else:
            problems.append(Problem(where, None, f"quantreg.config[{i}]",
                                    f"expected a path (a non-empty string), got {type_name(entry)}; this entry is "
                                    "ignored"))
    strict = raw.get("strict")
    if strict is not None and not isinstance(strict, bool):
        word = strict.strip().lower() if isinstance(strict, str) else None
        if word in settings.TRUE_WORDS or word in settings.FALSE_WORDS:
            problems.append(Problem(where, None, "quantreg.strict",
                                    f"expected true or false, got the string {settings.shown(str(strict))}; read as "
                                    f"{'true' if word in settings.TRUE_WORDS else 'false'}"))
            strict = word in settings.TRUE_WORDS
        else:
            problems.append(Problem(where, None, "quantreg.strict",
                                    f"expected true or false, got {type_name(strict)}; ignored (not strict)"))
            strict = None
    return RunSettings(tuple(paths), strict, tuple(problems))


_reported: set[Problem] = set()


def report_problems(run: RunSettings | None, strict: bool) -> None:
    """Strict: raise the run settings' problems. Lenient: one WARNING per problem and process."""
    if run is None or not run.problems:
        return
    if strict:
        raise QuantregError(list(run.problems))
    for problem in run.problems:
        if problem not in _reported:
            _reported.add(problem)
            logger.warning("quantreg: %s", problem)
