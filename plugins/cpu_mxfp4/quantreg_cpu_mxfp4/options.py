"""Rule options of ``cpu_mxfp4`` (``options:`` in a quantreg table), checked at construction.

* ``alpha``, ``limit`` (defaults GPT-OSS's, :mod:`quantreg.models.gpt_oss`): SwiGLU-OAI parameters.
* ``routing``: how tokens pick experts. ``auto`` (default): GPT-OSS layers take top-k of the
  logits then softmax over those k (the same experts and weights as softmax -> top-k ->
  renormalise), other models softmax over all experts -> top-k -> renormalise; any routing the
  method does not compute (grouped top-k, a custom routing function, hash routing, ...; see
  :func:`.routing.unsupported_routing`) goes to vLLM's router. ``topk_softmax`` / ``softmax_topk``
  force one in-method order (refused on a layer whose routing they do not compute); ``vllm``
  always uses vLLM's router (the method then runs modular).
* ``precision``: how the kernel quantises activations for its int8 GEMV. ``q8x2`` (Q8 plus a Q8
  residual, ~0.3 % error) or ``q8`` (plain Q8 per 32 values, ggml's Q8_0: 1.1-1.9 % error, half
  the dot products: the faster setting at every token count, see :mod:`.kernel`). Unset: the
  process default, ``QUANTREG_CPU_MXFP4_PRECISION`` or ``q8x2``. Why a rule option: the trade of
  accuracy for speed is the operator's, per key and token range (a ``tokens:`` rule pair can take
  ``q8`` for decode only), and ``explain`` shows it; an environment variable said nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from quantreg.models.gpt_oss import DEFAULT_ALPHA, DEFAULT_LIMIT

from .plugin import OPTIONS, PRECISIONS, ROUTINGS

__all__ = ["FIELDS", "PRECISIONS", "ROUTINGS", "MethodOptions"]


@dataclass(frozen=True)
class MethodOptions:
    alpha: float = DEFAULT_ALPHA
    limit: float = DEFAULT_LIMIT
    routing: str = "auto"
    precision: str = ""  # "": the process default (kernel.precision())

    @classmethod
    def parse(cls, method: str, options: Mapping[str, Any]) -> MethodOptions:
        """Validate ``options``; unknown names are a TypeError naming them and the accepted ones."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"method '{method}' got unknown option(s) {', '.join(repr(u) for u in unknown)}; "
                            f"accepted: {', '.join(OPTIONS)}")
        alpha = _positive(method, "alpha", options.get("alpha", cls.alpha))
        limit = _positive(method, "limit", options.get("limit", cls.limit))
        routing = options.get("routing", cls.routing)
        if routing not in ROUTINGS:
            raise ValueError(f"method '{method}': option routing={routing!r} is not one of {', '.join(ROUTINGS)}")
        precision = options.get("precision", cls.precision)
        if precision != cls.precision and precision not in PRECISIONS:
            raise ValueError(f"method '{method}': option precision={precision!r} is not one of {', '.join(PRECISIONS)}")
        return cls(alpha, limit, routing, precision)


FIELDS: tuple[str, ...] = tuple(f.name for f in fields(MethodOptions))
"""One field per registered option (a plugin test checks ``FIELDS == plugin.OPTIONS``)."""


def _positive(method: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"method '{method}': option {name}={value!r} must be a positive finite number")
    return float(value)
