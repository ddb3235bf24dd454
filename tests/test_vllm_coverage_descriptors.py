"""Seam coverage of overrides that are not plain functions (issue 21 class 9).

A ``_get_quant_method`` that is a staticmethod, a classmethod or a callable object on the class
is legal Python; quantreg must pass it through as Python would bind it, with one WARNING per
(class, key), and never break the layer. Real ``RoutedExperts`` subclasses in real layers built
by vLLM's ``FusedMoEFactory`` (the harness and fixtures of tests/test_vllm_coverage.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_vllm_coverage import KEY, TO_REFERENCE, harness, install, method_name, needs_vllm, records, uninstall

__all__ = ["harness", "records", "uninstall"]  # the fixtures, used by name


def descriptor_subclasses() -> dict[str, type[Any]]:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    class Static(RoutedExperts):  # type: ignore[misc]
        @staticmethod
        def _get_quant_method(prefix: str, quant_config: Any, moe_config: Any) -> Any:
            return UnquantizedFusedMoEMethod(moe_config)

    class ClassLevel(RoutedExperts):  # type: ignore[misc]
        @classmethod
        def _get_quant_method(cls, prefix: str, quant_config: Any, moe_config: Any) -> Any:
            assert cls.__name__ == "ClassLevel"
            return UnquantizedFusedMoEMethod(moe_config)

    class Chooser:
        def __call__(self, prefix: str, quant_config: Any, moe_config: Any) -> Any:
            return UnquantizedFusedMoEMethod(moe_config)

    class CallableObject(RoutedExperts):  # type: ignore[misc]
        _get_quant_method = Chooser()

    return {c.__name__: c for c in (Static, ClassLevel, CallableObject)}


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize(("name", "kind"), [("Static", "a staticmethod"), ("ClassLevel", "a classmethod"),
                                            ("CallableObject", "a callable Chooser object")])
def test_non_function_overrides_pass_through_with_one_warning(name: str, kind: str, tmp_path: Path, harness: Any,
                                                              records: Any, uninstall: list[Any]) -> None:
    classes = descriptor_subclasses()
    install(tmp_path, TO_REFERENCE, uninstall)
    for _ in range(2):
        layer = harness.build_routed(routed_experts_cls=classes[name])
        assert method_name(layer) == "UnquantizedFusedMoEMethod"  # the override's own choice, as without quantreg
    found = records.warnings(f"{name}._get_quant_method is {kind}", "could not decide", KEY)
    assert len(found) == 1, records.lines
