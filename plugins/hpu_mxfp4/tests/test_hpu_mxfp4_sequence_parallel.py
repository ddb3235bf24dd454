"""Sequence-parallel MoE with one DP rank: the Gaudi methods gather only under vllm-gaudi's fast-path runner.

See :mod:`quantreg_hpu_mxfp4.sequence_parallel` for what vLLM 0.32's and vllm-gaudi's runners
do. The ``vllm_gaudi`` double (conftest.py) plays a two-rank EP group seen from rank 0: its
``dispatch_tensor`` appends the peer's tensor and records the dtype and the SP flag.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
from quantreg_hpu_mxfp4 import method as methods
from quantreg_hpu_mxfp4.testing import FakeLayer, make_experts, make_tokens, moe_config

pytestmark = pytest.mark.vllm

GLOBAL, LOCAL, TOP_K, HIDDEN, INTER = 8, 4, 2, 64, 64


def sp_config() -> Any:
    """ep_rank 0 of 2 (TP 2 + EP), one DP rank, sp_size 2 (what use_sequence_parallel_moe gives)."""
    base = moe_config(num_global=GLOBAL, num_local=LOCAL, top_k=TOP_K, hidden=HIDDEN, intermediate=INTER,
                      bias=True, ep_rank=0, dp_size=1)
    parallel = dataclasses.replace(base.moe_parallel_config, sp_size=2,  # with EP, MoE tp_size is 1
                                   all2all_backend="allgather_reducescatter")
    return dataclasses.replace(base, moe_parallel_config=parallel)


@pytest.fixture
def fast_path(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("vllm_gaudi.ops.hpu_fused_moe")
    module._MOE_COMPILE = True  # type: ignore[attr-defined]  # HPU_FUSED_MOE=1, vllm-gaudi's default
    monkeypatch.setitem(sys.modules, "vllm_gaudi.ops", types.ModuleType("vllm_gaudi.ops"))
    monkeypatch.setitem(sys.modules, "vllm_gaudi.ops.hpu_fused_moe", module)
    return module


@pytest.mark.parametrize("cls", [methods.HpuMxfp4MoEMethod, methods.HpuMxfp4DequantMoEMethod])
def test_gathers_tokens_when_the_fast_path_skips_dispatch(hpu: Any, vllm_gaudi: Any, fast_path: Any,
                                                          cls: type) -> None:
    config = sp_config()
    assert config.is_sequence_parallel and config.dp_size == 1
    method = cls(config)
    layer = FakeLayer(method, config, make_experts(LOCAL, HIDDEN, INTER, bias=True, seed=3))
    x, _, _ = make_tokens(3, HIDDEN, GLOBAL, TOP_K, seed=4)
    peer_x, peer_ids, peer_w = make_tokens(2, HIDDEN, GLOBAL, TOP_K, seed=5)
    vllm_gaudi.peers = [peer_x, peer_ids, peer_w.to(torch.bfloat16)]
    out = method.apply_monolithic(layer, x, torch.randn(3, GLOBAL, generator=torch.Generator().manual_seed(6)))
    assert out.shape == (5, HIDDEN)  # this rank's 3 tokens + the peer's 2: the combine scatters them back
    assert [flag for _, flag in vllm_gaudi.dispatched] == [True, True, True]
    call = hpu.calls[-1]
    assert call.args[0].shape[0] == 5 and call.args[1].shape == (5, TOP_K)
    assert torch.equal(call.args[0][3:], peer_x)


def test_no_gather_without_the_fast_path_or_for_the_reference(hpu: Any, vllm_gaudi: Any, fast_path: Any) -> None:
    config = sp_config()
    x, _, _ = make_tokens(3, HIDDEN, GLOBAL, TOP_K, seed=4)
    logits = torch.randn(3, GLOBAL, generator=torch.Generator().manual_seed(6))
    reference = methods.Mxfp4ReferenceMoEMethod(config)  # stock vLLM's runner dispatches for it
    layer = FakeLayer(reference, config, make_experts(LOCAL, HIDDEN, INTER, bias=True, seed=3))
    assert reference.apply_monolithic(layer, x, logits).shape == x.shape
    fast_path._MOE_COMPILE = False  # HPU_FUSED_MOE=0: vLLM's own runner forward dispatches
    native = methods.HpuMxfp4MoEMethod(config)
    layer = FakeLayer(native, config, make_experts(LOCAL, HIDDEN, INTER, bias=True, seed=3))
    assert native.apply_monolithic(layer, x, logits).shape == x.shape
    assert vllm_gaudi.dispatched == []
