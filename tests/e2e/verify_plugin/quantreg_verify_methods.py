"""The broken method of the verify plugin (imported only when a table chooses it)."""

from __future__ import annotations

from typing import Any

from quantreg_hpu_mxfp4.method import Mxfp4ReferenceMoEMethod


class NibblesSwappedMethod(Mxfp4ReferenceMoEMethod):  # type: ignore[misc]
    """``mxfp4_reference`` after swapping the low and high nibble of every w13 byte in place.

    In place on purpose: ``verify:`` must copy the loaded weights for the ``against`` method
    before the chosen method's ``process_weights_after_loading`` changes them.
    """

    quantreg_name = "nibbles_swapped"

    def process_weights_after_loading(self, layer: Any) -> None:
        packed = layer.w13_weight.data
        packed.copy_(((packed & 0x0F) << 4) | (packed >> 4))
        super().process_weights_after_loading(layer)
