"""Method classes of the e2e plugin (imported only when chosen, like any plugin's)."""

from __future__ import annotations

from typing import Any

from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod


class E2EUnquantizedMethod(UnquantizedFusedMoEMethod):  # type: ignore[misc]
    """vLLM's unquantized MoE method, renamed, remembering the rule's ``tag`` option."""

    def __init__(self, moe: Any, tag: str = "") -> None:
        super().__init__(moe)
        self.tag = tag


class E2EBrokenMethod(UnquantizedFusedMoEMethod):  # type: ignore[misc]
    """A third-party method whose constructor fails at layer build time."""

    def __init__(self, moe: Any) -> None:
        raise RuntimeError("e2e: kernel library failed to initialise")
