"""Quant-config keepers: how a plugin tells quantreg that a third party may strip a quant config.

Some hardware plugins rewrite a checkpoint's quantization before vLLM fixes it: vllm-gaudi's
``models/gptoss_mxfp4.py`` makes vLLM load GPT-OSS MXFP4 checkpoints as bf16 unless its
own switch is set (plugin #1 documents it). The key vLLM then reports is ``(unquantized, gpt_oss, hpu)``, so a table
rule for ``(gpt_oss_mxfp4, gpt_oss, hpu)`` could never match: the old switch would beat the table.

A plugin that knows such a third party registers a :class:`QuantConfigKeeper` (hook
``register_quant_config_keepers``). quantreg then asks the *table* whether the quant config must
be kept: it must when the effective table's decision for ``(quant_format, model_type, device)``
is a quantreg method (not ``vllm``, and not a fallback to ``vllm``). The device is vLLM's own,
and the answer comes from the decision, never from the device name, so the mechanism runs (and
is tested) on ``cpu`` just as on ``hpu``. The keeper's ``target`` is what acts on the answer.

Plain strings only: listing or validating keepers imports neither torch nor vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .keys import Key

if TYPE_CHECKING:
    from .decision import Decision

_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_MODULE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*$")


@dataclass(frozen=True)
class QuantConfigKeeper:
    """One (checkpoint quant method, model type) whose quant config a third party may strip.

    ``quant_method`` is the checkpoint's ``quantization_config.quant_method`` (``mxfp4``);
    ``quant_format`` the name vLLM gives that config in a key (``gpt_oss_mxfp4``: what
    ``quant_config.get_name()`` returns once the config is kept). ``module`` is the third
    party's module that does the stripping; ``target`` (``"package.module:function"``) is
    called once per process as ``target(module, should_keep)`` right after ``module`` is
    imported (at once if it already is), whichever of the two plugins vLLM loaded first.
    ``should_keep()`` answers from the table, at call time, for this process's device; the
    target must make the third party consult it *when it reads its switch*, not copy its value
    (the device and the table are only known once vLLM runs). It may return a zero-argument
    undo callable (used by ``quantreg.vllm.unregister()`` in tests).
    """

    name: str
    quant_method: str
    quant_format: str
    model_type: str
    module: str
    target: str
    description: str = ""
    plugin: str = ""

    def key(self, device: str) -> Key:
        return Key(self.quant_format, self.model_type, device)

    def matches(self, model_type: str | None, quant_method: str | None) -> bool:
        """Whether a checkpoint (hf ``model_type``, raw ``quant_method``) is this keeper's case."""
        return model_type == self.model_type and (quant_method or "").lower() == self.quant_method.lower()


def keeps_quant_config(decision: Decision) -> bool:
    """The table's answer: keep the quant config when a quantreg method was chosen for the key."""
    return not decision.keeps_vllm


def keeper_problem(keeper: object) -> str | None:
    """Why a registered object is not a usable keeper (``None`` if it is)."""
    if not isinstance(keeper, QuantConfigKeeper):
        return f"register() expects a quantreg.keepers.QuantConfigKeeper, got {type(keeper).__name__}"
    for field in ("name", "quant_method", "quant_format", "model_type"):
        value = getattr(keeper, field)
        if not isinstance(value, str) or not value:
            return f"keeper {keeper.name!r}: field {field} must be a non-empty string, got {value!r}"
    if not isinstance(keeper.module, str) or not _MODULE.match(keeper.module):
        return f"keeper {keeper.name!r}: module {keeper.module!r} is not a dotted module name"
    if not isinstance(keeper.target, str) or not _TARGET.match(keeper.target):
        return f"keeper {keeper.name!r}: target {keeper.target!r} is not of the form 'package.module:function'"
    return None
