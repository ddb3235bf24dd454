"""quantreg: a declarative registry choosing vLLM's MoE quantization method per key.

Public API: :class:`Key`, :class:`Method`, :class:`BuildContext`, :class:`Decision`, :func:`resolve`,
:func:`get_registry`, :data:`hookimpl`, and every type a plugin constructs or is handed:
:class:`Finding` (``doctor_findings``), :class:`QuantConfigKeeper` (``register_quant_config_keepers``),
:class:`VllmLimitation` (``register_vllm_limitations``), :func:`keeps_quant_config`, :class:`Answer`.
Plugins import these from ``quantreg``, never from its modules, so modules can move.
Importing this package never imports torch or vLLM; the plugin-facing types are loaded on first
use (PEP 562), so a vLLM start-up that needs none of them does not pay for their modules.
"""

from typing import TYPE_CHECKING, Any

from .hookspecs import hookimpl
from .keys import Key, Match
from .methods import VLLM_METHOD, Availability, BuildContext, Method
from .problems import Problem, QuantregError
from .registry import Registry, get_registry, resolve, set_registry
from .table.file import Rule, Tier

#: The pre-issue-47 name of :class:`Tier` (a table's precedence tier), kept for plugins that import it.
Layer = Tier

if TYPE_CHECKING:
    from .answer import Answer
    from .decision import Candidate, ChainStep, Decision
    from .findings import Finding
    from .keepers import QuantConfigKeeper, keeps_quant_config
    from .vllm_limits import VllmLimitation

#: Public name -> the module that holds it, imported on first use.
_LAZY = {
    "Answer": "answer",
    "Candidate": "decision",
    "ChainStep": "decision",
    "Decision": "decision",
    "Finding": "findings",
    "QuantConfigKeeper": "keepers",
    "keeps_quant_config": "keepers",
    "VllmLimitation": "vllm_limits",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'quantreg' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "VLLM_METHOD",
    "Answer",
    "Availability",
    "BuildContext",
    "Candidate",
    "ChainStep",
    "Decision",
    "Finding",
    "Key",
    "Layer",
    "Match",
    "Method",
    "Problem",
    "QuantConfigKeeper",
    "QuantregError",
    "Registry",
    "Rule",
    "Tier",
    "VllmLimitation",
    "get_registry",
    "hookimpl",
    "keeps_quant_config",
    "resolve",
    "set_registry",
]
