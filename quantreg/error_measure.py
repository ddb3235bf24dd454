"""The one error measure, ``max |out - ref| / max |ref|``, and its one default bound.

Why one module: the table's ``verify:`` spec, the float64 GPT-OSS reference, the conformance kit
and plugin #1's tests each had their own copy of the measure, and the kit and ``verify:`` had two
defaults (1e-2 and 0.02). A method that guarantees a tighter bound declares it
(``quantreg_tolerance`` on its class, as plugin #1's methods do); ``verify:`` rules set
``tolerance:``. Torch-free (duck-typed on tensors), so the table pipeline can import it.
"""

from __future__ import annotations

import math
from typing import Any

DEFAULT_TOLERANCE = 0.02
"""The documented ``verify:`` default, and the kit's for a method that declares none. bf16
activations and outputs cost ~0.5 %; every classic mistake moves the output by more than 15 %."""


def relative_error(out: Any, ref: Any) -> float:
    """``max |out - ref| / max |ref|`` of two tensors, in float64 (``inf`` if ``out`` is not finite).

    ``0.0`` for empty tensors; a zero reference divides by 1 (the error is then absolute).
    """
    diff = (out.double() - ref.double()).abs()
    if diff.numel() == 0:
        return 0.0
    if not bool(diff.isfinite().all()):
        return math.inf
    scale = float(ref.double().abs().max())
    return float(diff.max()) / (scale if scale > 0 else 1.0)
