"""A throwaway plugin whose methods' curves cross (or do not) at known token counts: ``quantreg tune``'s crossover.

Each method is ``mxfp4_reference`` (correct: tune's float64 check passes at every count) plus a
sleep that sets its curve, so which is faster where is known. The output for an input already
seen is kept and returned again (tune times the same inputs every round), so after the warm-up a
timed forward is vLLM's layer around one dictionary lookup and the sleep: compute, which a loaded
host stretches unevenly, does not blur the curves. The sleeps are steps of tens to hundreds of
milliseconds: on a shared 2-core host under a load of 10-20 a forward's time wanders by tens of
milliseconds or more, and a 2x-20x gap survives that.

* ``tune_decode``: 20 ms up to :data:`STEP` (8) tokens, 400 ms above;
* ``tune_prefill``: 200 ms whatever the count;
* ``tune_flat``: 100 ms whatever the count.

Entry point ``crossing`` (module ``quantreg_tune_crossing``) registers ``tune_decode`` and
``tune_prefill``: ``tune_decode`` is faster up to 8 tokens (20 vs 200 ms), ``tune_prefill`` from
16 on (200 vs 400 ms), so tune must write the pair ``tokens: "<=8"`` -> ``tune_decode``,
``tokens: ">8"`` -> ``tune_prefill``. Entry point ``parallel`` (module ``quantreg_tune_parallel``)
registers ``tune_flat`` and ``tune_prefill``: ``tune_flat`` is faster at every count, so no
crossover. A test disables one of the two (``QUANTREG_DISABLE_PLUGINS``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from quantreg_hpu_mxfp4.method import Mxfp4ReferenceMoEMethod

import quantreg

STEP = 8
#: method -> (ms slept up to STEP tokens, ms slept above)
CURVES = {"tune_decode": (20.0, 400.0), "tune_prefill": (200.0, 200.0), "tune_flat": (100.0, 100.0)}


def register(names: tuple[str, ...], register: Callable[[quantreg.Method], None]) -> None:
    """Register ``names`` (keys of :data:`CURVES`), each one this module's class of that curve."""
    for name in names:
        small, large = CURVES[name]
        cls = "".join(part.title() for part in name.split("_")) + "Method"
        register(quantreg.Method(name=name, target=f"quantreg_tune_crossover:{cls}", requires=("torch", "vllm"),
                                 description=f"mxfp4_reference, then {small:g} ms to {STEP} tokens, {large:g} above"))


def _key(tensors: tuple[Any, ...]) -> tuple[Any, ...]:
    """The exact content of a forward's input tensors (the layer's own argument skipped)."""
    return tuple((str(t.dtype), tuple(t.shape), t.detach().contiguous().cpu().view(-1).view(torch.uint8)
                  .numpy().tobytes()) for t in tensors if isinstance(t, torch.Tensor))


class _Curved(Mxfp4ReferenceMoEMethod):  # type: ignore[misc]
    small_ms = 0.0
    large_ms = 0.0

    def _run_curved(self, compute: Callable[[], Any], tensors: tuple[Any, ...]) -> Any:
        cache: dict[tuple[Any, ...], Any] = self.__dict__.setdefault("_outputs", {})
        key = _key(tensors)
        if key not in cache:
            cache[key] = compute()
        out = cache[key].clone()
        time.sleep((self.small_ms if out.shape[0] <= STEP else self.large_ms) / 1000.0)
        return out

    def apply_monolithic(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
        return self._run_curved(lambda: super(_Curved, self).apply_monolithic(layer, *args, **kwargs),
                                (*args, *kwargs.values()))

    def apply(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
        return self._run_curved(lambda: super(_Curved, self).apply(layer, *args, **kwargs),
                                (*args, *kwargs.values()))


class TuneDecodeMethod(_Curved):
    small_ms, large_ms = CURVES["tune_decode"]


class TunePrefillMethod(_Curved):
    small_ms, large_ms = CURVES["tune_prefill"]


class TuneFlatMethod(_Curved):
    small_ms, large_ms = CURVES["tune_flat"]
