"""Rule options of the methods (``options:`` in a quantreg table), checked at construction.

* ``alpha``, ``limit`` (defaults GPT-OSS's, :mod:`quantreg.models.gpt_oss`): SwiGLU-OAI parameters of
  the bias kernels.
* ``routing``: how tokens pick experts.
  ``auto`` (default) follows vllm-gaudi: GPT-OSS models take top-k of the logits then softmax
  over those k; other models use vLLM's router for grouped top-k or custom routing, otherwise
  softmax over all experts, top-k, renormalise. ``topk_softmax`` and ``softmax_topk`` force one of
  the two in-method orders; ``vllm`` always uses vLLM's router (the method then runs modular).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from quantreg.models.gpt_oss import DEFAULT_ALPHA, DEFAULT_LIMIT

ROUTINGS = ("auto", "topk_softmax", "softmax_topk", "vllm")


@dataclass(frozen=True)
class MethodOptions:
    alpha: float = DEFAULT_ALPHA
    limit: float = DEFAULT_LIMIT
    routing: str = "auto"

    @classmethod
    def parse(cls, method: str, options: Mapping[str, Any]) -> MethodOptions:
        """Validate ``options``; unknown names are a TypeError naming them and the accepted ones."""
        unknown = sorted(set(options) - set(NAMES))
        if unknown:
            raise TypeError(
                f"method '{method}' got unknown option(s) {', '.join(repr(u) for u in unknown)}; "
                f"accepted: {', '.join(NAMES)}"
            )
        alpha = _positive(method, "alpha", options.get("alpha", cls.alpha))
        limit = _positive(method, "limit", options.get("limit", cls.limit))
        routing = options.get("routing", cls.routing)
        if routing not in ROUTINGS:
            raise ValueError(f"method '{method}': option routing={routing!r} is not one of {', '.join(ROUTINGS)}")
        return cls(alpha, limit, routing)


NAMES: tuple[str, ...] = tuple(f.name for f in fields(MethodOptions))
"""Rule options every method of the plugin accepts (what ``plugin.py`` registers): the fields above."""


def _positive(method: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"method '{method}': option {name}={value!r} must be a positive finite number")
    return float(value)
