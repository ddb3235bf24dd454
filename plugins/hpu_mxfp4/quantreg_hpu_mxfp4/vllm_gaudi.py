"""What this plugin knows about vllm-gaudi: its GPT-OSS MXFP4 switch, kept in step with the table.

vllm-gaudi's ``vllm_gaudi/models/gptoss_mxfp4.py`` reads ``HPU_MXFP4_NATIVE`` once into a
module global of the same name, and two of its patches read that global when they run:

* ``ModelArchConfigConvertorBase._normalize_quantization_config`` returns ``None`` for
  ``gpt_oss`` + ``quant_method: mxfp4`` unless it is true (vLLM then builds no quant config);
* ``GptOssModel.load_weights`` dequantises the packed experts to bf16 while loading unless it
  is true (otherwise vLLM's own MXFP4 loader fills the uint8 parameters).

The keeper below (hook ``register_quant_config_keepers``) replaces that global with a
:class:`TableSwitch`: true when the operator set ``HPU_MXFP4_NATIVE=1`` (the flag keeps its
meaning), otherwise the table's answer for ``(gpt_oss_mxfp4, gpt_oss, device)``. One object
serves both readers, so the quant config and the loader never disagree, and it is consulted
when vllm-gaudi's code runs, so it does not matter which plugin vLLM loaded first.

The doctor findings (hook ``doctor_findings``) say what vllm-gaudi will do to each GPT-OSS
key on this host. Nothing here imports torch, vLLM or vllm-gaudi at module level.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

from quantreg import Decision, Finding, Key, keeps_quant_config

from .keeper import VLLM_GAUDI_MODULE

VLLM_GAUDI = "vllm_gaudi"
MODULE = VLLM_GAUDI_MODULE
SWITCH = "HPU_MXFP4_NATIVE"
QUANT_FORMAT = "gpt_oss_mxfp4"
MODEL_TYPE = "gpt_oss"



class TableSwitch:
    """Stands in for vllm-gaudi's ``HPU_MXFP4_NATIVE`` module global.

    Truthy when the operator's flag was true, else when ``should_keep()`` (the table) says so.
    vllm-gaudi tests the global only for truth (``if HPU_MXFP4_NATIVE`` / ``if not ...``), which
    is what makes an object with ``__bool__`` a faithful replacement; ``==`` with a bool and
    ``int()`` follow the same answer in case a later version compares instead.
    """

    def __init__(self, operator: bool, should_keep: Callable[[], bool]) -> None:
        self.operator = operator
        self.should_keep = should_keep

    def __bool__(self) -> bool:
        return self.operator or bool(self.should_keep())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (bool, int)):
            return bool(self) == bool(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(bool(self))

    def __int__(self) -> int:
        return int(bool(self))

    def __repr__(self) -> str:
        return f"TableSwitch(operator={self.operator}, table=<decided when read>)"


def keep_native(module: ModuleType, should_keep: Callable[[], bool]) -> Callable[[], None]:
    """The keeper's target: put a :class:`TableSwitch` where vllm-gaudi reads its switch."""
    current: Any = getattr(module, SWITCH, None)
    if current is None:
        raise AttributeError(f"{module.__name__} has no {SWITCH}: this vllm-gaudi strips MXFP4 some other way")
    if isinstance(current, TableSwitch):
        return lambda: None
    setattr(module, SWITCH, TableSwitch(bool(current), should_keep))

    def undo() -> None:
        setattr(module, SWITCH, current)

    return undo


def operator_native(env: dict[str, str] | None = None) -> bool:
    """vllm-gaudi's own reading of the flag (``os.environ.get("HPU_MXFP4_NATIVE", "0") == "1"``)."""
    value = (os.environ if env is None else env).get(SWITCH, "0")
    return value == "1"


def installed() -> bool:
    """vllm-gaudi is importable here (looked up, not imported: its import loads vLLM)."""
    try:
        return importlib.util.find_spec(VLLM_GAUDI) is not None
    except (ImportError, ValueError):
        return False


def findings(resolve: Callable[[Key], Decision], device: str, env: dict[str, str] | None = None,
             vllm_gaudi_installed: bool | None = None) -> list[Finding]:
    """What vllm-gaudi will do to the GPT-OSS keys on ``device`` with this table (``resolve``) and flag."""
    installed_here = installed() if vllm_gaudi_installed is None else vllm_gaudi_installed
    if not installed_here:
        return []
    key = Key(QUANT_FORMAT, MODEL_TYPE, device)
    bf16 = Key("unquantized", MODEL_TYPE, device)
    decision = resolve(key)
    flag = (os.environ if env is None else env).get(SWITCH)
    if operator_native(env):
        return [Finding("info", f"vllm-gaudi keeps GPT-OSS MXFP4 quant configs ({SWITCH}=1) and loads packed "
                        f"weights; the table decides: {decision.method} [{decision.source}]", key)]
    if keeps_quant_config(decision):
        return [Finding("info", f"{SWITCH} is {flag or 'unset'} but the table chose '{decision.method}' "
                        f"[{decision.source}]: quantreg keeps the MXFP4 quant config and vllm-gaudi loads the "
                        "packed weights (its native loader)", key)]
    after = resolve(bf16)
    reason = f"; {decision.fallback}" if decision.fallback else ""
    return [Finding("warning", f"vllm-gaudi strips the MXFP4 quant config ({SWITCH} is {flag or 'unset'} and the "
                    f"table says vllm [{decision.source}]{reason}) and dequantises the experts to bf16 in "
                    f"load_weights: GPT-OSS MXFP4 checkpoints arrive as {bf16} -> {after.method} "
                    f"[{after.source}]", key)]
