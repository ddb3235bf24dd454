"""A throwaway plugin whose methods' curves cross (or do not) at known token counts: ``quantreg tune``'s crossover.

Each method is ``mxfp4_reference`` (correct: tune's float64 check passes at every count) plus a
sleep that sets its curve on top of the same compute, so which is faster where is known:

* ``tune_decode``: 0.5 ms per token (1 token 0.5 ms ... 512 tokens 256 ms);
* ``tune_prefill``: 8 ms whatever the count;
* ``tune_flat``: 2 ms whatever the count.

Entry point ``crossing`` (module ``quantreg_tune_crossing``) registers ``tune_decode`` and
``tune_prefill``: ``tune_decode`` is faster up to 8 tokens (4 vs 8 ms), they tie at 16,
``tune_prefill`` is faster from 32 on, so tune must write the pair ``tokens: "<=8"`` ->
``tune_decode``, ``tokens: ">8"`` -> ``tune_prefill``. Entry point ``parallel`` (module
``quantreg_tune_parallel``) registers ``tune_flat`` and ``tune_prefill``: ``tune_flat`` is faster
at every count, so no crossover. A test disables one of the two (``QUANTREG_DISABLE_PLUGINS``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from quantreg_hpu_mxfp4.method import Mxfp4ReferenceMoEMethod

import quantreg

#: method -> (fixed ms, ms per token) of its sleep
CURVES = {"tune_decode": (0.0, 0.5), "tune_prefill": (8.0, 0.0), "tune_flat": (2.0, 0.0)}


def register(names: tuple[str, ...], register: Callable[[quantreg.Method], None]) -> None:
    """Register ``names`` (keys of :data:`CURVES`), each one this module's class of that curve."""
    for name in names:
        fixed, per_token = CURVES[name]
        cls = "".join(part.title() for part in name.split("_")) + "Method"
        register(quantreg.Method(name=name, target=f"quantreg_tune_crossover:{cls}", requires=("torch", "vllm"),
                                 description=f"mxfp4_reference plus {fixed:g} ms + {per_token:g} ms per token"))


class _Curved(Mxfp4ReferenceMoEMethod):  # type: ignore[misc]
    fixed_ms = 0.0
    per_token_ms = 0.0

    def _sleep(self, out: Any) -> Any:
        time.sleep((self.fixed_ms + self.per_token_ms * out.shape[0]) / 1000.0)
        return out

    def apply_monolithic(self, *args: Any, **kwargs: Any) -> Any:
        return self._sleep(super().apply_monolithic(*args, **kwargs))

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        return self._sleep(super().apply(*args, **kwargs))


class TuneDecodeMethod(_Curved):
    fixed_ms, per_token_ms = CURVES["tune_decode"]


class TunePrefillMethod(_Curved):
    fixed_ms, per_token_ms = CURVES["tune_prefill"]


class TuneFlatMethod(_Curved):
    fixed_ms, per_token_ms = CURVES["tune_flat"]
