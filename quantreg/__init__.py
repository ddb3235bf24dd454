"""quantreg: a declarative registry choosing vLLM's MoE quantization method per key.

Public API: :class:`Key`, :class:`Method`, :class:`BuildContext`, :class:`Decision`, :func:`resolve`,
:func:`get_registry`, :data:`hookimpl`. Importing this package never imports torch or vLLM.
"""

from .decision import Candidate, ChainStep, Decision
from .hookspecs import hookimpl
from .keys import Key, Match
from .methods import VLLM_METHOD, Availability, BuildContext, Method
from .problems import Problem, QuantregError
from .registry import Registry, get_registry, resolve, set_registry
from .table.file import Layer, Rule

__all__ = [
    "VLLM_METHOD",
    "Availability",
    "BuildContext",
    "Candidate",
    "ChainStep",
    "Decision",
    "Key",
    "Layer",
    "Match",
    "Method",
    "Problem",
    "QuantregError",
    "Registry",
    "Rule",
    "get_registry",
    "hookimpl",
    "resolve",
    "set_registry",
]
