"""The recorder plugin's method classes (imported only when a table chooses them, like any plugin's)."""

from __future__ import annotations

import os
from typing import Any, ClassVar

from quantreg_hpu_mxfp4.method import Mxfp4ReferenceMoEMethod


class _Recorded(Mxfp4ReferenceMoEMethod):  # type: ignore[misc]
    name: ClassVar[str] = ""

    def apply_monolithic(self, layer: Any, x: Any, router_logits: Any, input_ids: Any = None, **kw: Any) -> Any:
        """One line per forward, then the reference's forward: a write no trace can hold."""
        path = os.environ.get("QUANTREG_E2E_RECORD")
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"{self.name} {x.reshape(-1, x.shape[-1]).shape[0]} {os.getpid()}\n")
        return super().apply_monolithic(layer, x, router_logits, input_ids, **kw)


class RecordedSmall(_Recorded):
    name = "recorded_small"


class RecordedLarge(_Recorded):
    name = "recorded_large"
