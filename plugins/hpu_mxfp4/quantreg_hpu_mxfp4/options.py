"""Rule options of the methods (``options:`` in a quantreg table), checked at construction.

* ``alpha``, ``limit`` (defaults GPT-OSS's, :mod:`quantreg.models.gpt_oss`): SwiGLU-OAI parameters of
  the bias kernels.
* ``routing``: how tokens pick experts.
  ``auto`` (default) follows vllm-gaudi: GPT-OSS models take top-k of the logits then softmax
  over those k; other models use vLLM's router for grouped top-k or custom routing, otherwise
  softmax over all experts, top-k, renormalise. ``topk_softmax`` and ``softmax_topk`` force one of
  the two in-method orders; ``vllm`` always uses vLLM's router (the method then runs modular).
* ``max_experts_per_slice`` (``hpu_mxfp4_dequant`` only: the bf16 kernels): at most this many
  experts per kernel call; ``0`` never slices. Unset, it follows vllm-gaudi's
  ``MAX_EXPERTS_PER_SLICE`` environment variable (read the way vllm-gaudi reads it; unset,
  invalid or ``<= 0`` means no slicing), which some Gaudi software releases (1.20) need.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from quantreg.models.gpt_oss import DEFAULT_ALPHA, DEFAULT_LIMIT

from .plugin import OPTIONS, SLICING_METHODS, SLICING_OPTIONS

ROUTINGS = ("auto", "topk_softmax", "softmax_topk", "vllm")
SLICE_ENV = "MAX_EXPERTS_PER_SLICE"


@dataclass(frozen=True)
class MethodOptions:
    alpha: float = DEFAULT_ALPHA
    limit: float = DEFAULT_LIMIT
    routing: str = "auto"
    max_experts_per_slice: int | None = None

    @classmethod
    def parse(cls, method: str, options: Mapping[str, Any]) -> MethodOptions:
        """Validate ``options``; unknown names are a TypeError naming them and the accepted ones."""
        unknown = sorted(set(options) - set(names(method)))
        if unknown:
            raise TypeError(
                f"method '{method}' got unknown option(s) {', '.join(repr(u) for u in unknown)}; "
                f"accepted: {', '.join(names(method))}"
            )
        alpha = _positive(method, "alpha", options.get("alpha", cls.alpha))
        limit = _positive(method, "limit", options.get("limit", cls.limit))
        routing = options.get("routing", cls.routing)
        if routing not in ROUTINGS:
            raise ValueError(f"method '{method}': option routing={routing!r} is not one of {', '.join(ROUTINGS)}")
        most = options.get("max_experts_per_slice")
        if most is not None and (isinstance(most, bool) or not isinstance(most, int) or most < 0):
            raise ValueError(f"method '{method}': option max_experts_per_slice={most!r} must be an integer >= 0 "
                             "(0: never slice)")
        return cls(alpha, limit, routing, most)

    def experts_per_slice(self, env: Mapping[str, str] | None = None) -> int:
        """The slice size in force: the option, else vllm-gaudi's ``MAX_EXPERTS_PER_SLICE`` (0: none)."""
        if self.max_experts_per_slice is not None:
            return self.max_experts_per_slice
        raw = (os.environ if env is None else env).get(SLICE_ENV, "-1")
        try:
            value = int(raw)
        except ValueError:  # vllm-gaudi warns and uses -1
            return 0
        return max(value, 0)


def names(method: str) -> tuple[str, ...]:
    """The options ``method`` accepts, as ``plugin.py`` registers them."""
    return OPTIONS + (SLICING_OPTIONS if method in SLICING_METHODS else ())


FIELDS: tuple[str, ...] = tuple(f.name for f in fields(MethodOptions))
"""One field per registered option (a plugin test checks ``FIELDS == OPTIONS + SLICING_OPTIONS``)."""


def _positive(method: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"method '{method}': option {name}={value!r} must be a positive finite number")
    return float(value)
