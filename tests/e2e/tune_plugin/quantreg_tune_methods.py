"""The methods of the tune plugin (imported only when tune or a table builds them)."""

from __future__ import annotations

import time
from typing import Any

from quantreg_hpu_mxfp4.method import Mxfp4ReferenceMoEMethod

SLEEP_S = 0.03
"""A fixed part, so that a round on the tiny model takes seconds (the Ctrl-C test signals mid-round)."""


class SlowReferenceMethod(Mxfp4ReferenceMoEMethod):  # type: ignore[misc]
    """``mxfp4_reference`` run twice, then a fixed sleep: the same output, measurably later.

    Why twice and not only a sleep: at 20B shapes the reference takes ~0.5 s at 256 tokens, and a
    fixed 30 ms was within a loaded host's noise (tune_slow scored faster than the reference once);
    running the forward twice keeps it about twice as slow whatever the load does to both.
    """

    quantreg_name = "tune_slow"

    def apply_monolithic(self, *args: Any, **kwargs: Any) -> Any:
        super().apply_monolithic(*args, **kwargs)
        out = super().apply_monolithic(*args, **kwargs)
        time.sleep(SLEEP_S)
        return out

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        super().apply(*args, **kwargs)
        out = super().apply(*args, **kwargs)
        time.sleep(SLEEP_S)
        return out


class NibblesSwappedMethod(Mxfp4ReferenceMoEMethod):  # type: ignore[misc]
    """``mxfp4_reference`` after swapping the low and high nibble of every w13 byte in place."""

    quantreg_name = "tune_wrong"

    def process_weights_after_loading(self, layer: Any) -> None:
        packed = layer.w13_weight.data
        packed.copy_(((packed & 0x0F) << 4) | (packed >> 4))
        super().process_weights_after_loading(layer)
