"""Test doubles and helpers for the Gaudi path: what the plugin's tests and ``bench/pwal_bench.py`` share.

Why a module of the package (not the tests' conftest): the bench and any downstream test
suite import it normally. Nothing here is used by the methods themselves, and importing it
imports torch but not vLLM (:func:`moe_config` imports vLLM when called).

* :func:`install_hpu_doubles` stands in for ``habana_frameworks.torch``, ``torch.hpu``,
  ``torch.ops.hpu.mixture_of_experts`` and ``torch.compile(backend="hpu_backend")``. Its kernels
  first assert the exact call contract vllm-gaudi's MXFP4 method relies on, then compute with
  the pure-torch reference (:mod:`quantreg_hpu_mxfp4.reference`), so a method run through them
  gives the reference's numbers.
* :func:`install_vllm_gaudi_doubles` stands in for the two vllm-gaudi modules the methods import
  lazily (DP dispatch, kernel chunk tuning).
* Random MXFP4 experts and tokens, a float64 :func:`oracle`, a real vLLM :func:`moe_config`,
  and :class:`FakeLayer` (the attributes ``RoutedExperts`` gives a method).

Everything is installed through a ``pytest.MonkeyPatch`` the caller owns, so nothing outlives it.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from quantreg.error_measure import relative_error
from quantreg.formats.mxfp4 import dequantize_mxfp4_f64, random_mxfp4
from quantreg.models.gpt_oss import DEFAULT_ALPHA, DEFAULT_LIMIT
from quantreg.models.gpt_oss_moe import moe_f64

from . import reference

if TYPE_CHECKING:
    import pytest

MXFP4_KWARGS = {"block_size", "permuted_weights", "experts_min", "experts_max", "is_fp4", "chunk_size",
                "total_experts"}
CONTRACT = {
    # kernel: (positional tensors, keyword arguments, routing-table dtype)
    "bias_mxfp4_fused_weights": (9, MXFP4_KWARGS | {"alpha", "limit"}, torch.int32),
    "mxfp4_fused_weights": (7, MXFP4_KWARGS | {"activation"}, torch.int32),
    "bias_fused_weights": (7, {"permuted_weights", "experts_min", "experts_max", "chunk_size", "total_experts",
                               "alpha", "limit"}, torch.int64),
    "fused_weights": (5, {"permuted_weights", "activation", "experts_min", "experts_max", "chunk_size",
                          "total_experts"}, torch.int64),
}
TUPLE_DTYPES = {
    # kernel: dtype of each tuple argument, in positional order after the three leading tensors
    "bias_mxfp4_fused_weights": (torch.uint8, torch.uint8, torch.bfloat16, torch.bfloat16, torch.uint8, torch.uint8),
    "mxfp4_fused_weights": (torch.uint8, torch.uint8, torch.uint8, torch.uint8),
    "bias_fused_weights": (torch.bfloat16,) * 4,
    "fused_weights": (torch.bfloat16,) * 2,
}


@dataclass
class KernelCall:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class HpuDoubles:
    calls: list[KernelCall] = field(default_factory=list)
    compiled: list[str] = field(default_factory=list)
    synchronized: int = 0
    available: bool = True
    missing_ops: set[str] = field(default_factory=set)


def _check_contract(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    positional, keywords, table_dtype = CONTRACT[name]
    assert len(args) == positional, f"{name}: {len(args)} positional arguments, expected {positional}"
    assert set(kwargs) == keywords, f"{name}: keywords {sorted(kwargs)}, expected {sorted(keywords)}"
    hidden, table, weights = args[:3]
    assert hidden.dtype == torch.bfloat16 and hidden.dim() == 2
    assert table.dtype == table_dtype, f"{name}: routing table {table.dtype}, expected {table_dtype}"
    assert table.dim() == 2 and table.shape == weights.shape and table.shape[0] == hidden.shape[0]
    assert weights.dtype == hidden.dtype, "routing weights must be cast to the activation dtype"
    assert kwargs["permuted_weights"] is True
    local = kwargs["experts_max"] - kwargs["experts_min"] + 1
    for i, dtype in enumerate(TUPLE_DTYPES[name]):
        values = args[3 + i]
        assert isinstance(values, tuple), f"{name}: argument {3 + i} is {type(values).__name__}, not a tuple"
        assert len(values) == local, f"{name}: argument {3 + i} has {len(values)} experts, expected {local}"
        assert all(v.dtype == dtype for v in values), f"{name}: argument {3 + i} is not {dtype}"
    if "block_size" in kwargs:
        assert kwargs["block_size"] == 32 and kwargs["is_fp4"] is True


class _FakeMoePacket:
    """``torch.ops.hpu.mixture_of_experts``: contract checks, then the reference."""

    def __init__(self, doubles: HpuDoubles) -> None:
        self._doubles = doubles

    def overloads(self) -> list[str]:
        return [n for n in CONTRACT if n not in self._doubles.missing_ops]

    def __getattr__(self, name: str) -> Any:
        if name not in CONTRACT or name in self._doubles.missing_ops:
            raise AttributeError(name)
        kernel = getattr(reference, name)

        def call(*args: Any, **kwargs: Any) -> torch.Tensor:
            _check_contract(name, args, kwargs)
            self._doubles.calls.append(KernelCall(name, args, kwargs))
            return kernel(*args, **kwargs)

        return call


class _FakeHpuModule:
    def __init__(self, doubles: HpuDoubles) -> None:
        self._doubles = doubles

    def is_available(self) -> bool:
        return self._doubles.available

    def device_count(self) -> int:
        return 1 if self._doubles.available else 0

    def synchronize(self) -> None:
        self._doubles.synchronized += 1


def install_hpu_doubles(monkeypatch: pytest.MonkeyPatch) -> HpuDoubles:
    """The Gaudi stack's doubles, installed through ``monkeypatch``; returns what they record."""
    doubles = HpuDoubles()
    package = types.ModuleType("habana_frameworks")
    bridge = types.ModuleType("habana_frameworks.torch")
    package.torch = bridge  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "habana_frameworks", package)
    monkeypatch.setitem(sys.modules, "habana_frameworks.torch", bridge)
    monkeypatch.setattr(torch, "hpu", _FakeHpuModule(doubles), raising=False)
    monkeypatch.setattr(torch.ops, "hpu", types.SimpleNamespace(mixture_of_experts=_FakeMoePacket(doubles)),
                        raising=False)

    def fake_compile(fn: Any = None, *, backend: Any = "inductor", **options: Any) -> Any:
        assert backend == "hpu_backend", f"compiled with backend {backend!r}"
        doubles.compiled.append(getattr(fn, "__name__", repr(fn)))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    return doubles


@dataclass
class GaudiDoubles:
    """vllm-gaudi's DP helpers as a two-rank world seen from rank 0, plus its kernel tuning."""

    peers: list[torch.Tensor] = field(default_factory=list)  # the other rank's x, ids, weights, in call order
    dispatched: list[tuple[torch.dtype, bool]] = field(default_factory=list)
    metadata: Any = None
    moe_chunk: list[int] = field(default_factory=list)
    moe_token_boundary: list[int] = field(default_factory=list)


def install_vllm_gaudi_doubles(monkeypatch: pytest.MonkeyPatch) -> GaudiDoubles:
    """vllm-gaudi's DP helpers and kernel tuning, installed through ``monkeypatch``."""
    doubles = GaudiDoubles()
    dp_utils = types.ModuleType("vllm_gaudi.v1.worker.hpu_dp_utils")

    def dispatch_tensor(tensor: torch.Tensor, output: torch.Tensor | None = None,
                        is_sequence_parallel: bool = False) -> torch.Tensor:
        assert tensor.dim() == 2
        peer = doubles.peers.pop(0)
        doubles.dispatched.append((tensor.dtype, is_sequence_parallel))
        gathered = torch.cat([tensor, peer.to(tensor.dtype)])
        if output is not None:
            assert output.dtype == tensor.dtype, "all_gather_into_tensor needs matching dtypes"
            output.copy_(gathered)
            return output
        return gathered

    dp_utils.dispatch_tensor = dispatch_tensor  # type: ignore[attr-defined]
    dp_utils.get_hpu_dp_metadata = lambda: doubles.metadata  # type: ignore[attr-defined]
    runtime = types.ModuleType("vllm_gaudi.extension.runtime")
    runtime.get_config = lambda: types.SimpleNamespace(  # type: ignore[attr-defined]
        moe_chunk=doubles.moe_chunk, moe_token_boundary=doubles.moe_token_boundary)
    for name in ("vllm_gaudi", "vllm_gaudi.v1", "vllm_gaudi.v1.worker", "vllm_gaudi.extension"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm_gaudi.v1.worker.hpu_dp_utils", dp_utils)
    monkeypatch.setitem(sys.modules, "vllm_gaudi.extension.runtime", runtime)
    return doubles


@dataclass
class Experts:
    """Per-local-expert packed weights (vLLM layout) and biases."""

    w13: torch.Tensor  # uint8 [E, 2I, H/2]
    w13_scale: torch.Tensor  # uint8 [E, 2I, H/32]
    w2: torch.Tensor  # uint8 [E, H, I/2]
    w2_scale: torch.Tensor  # uint8 [E, H, I/32]
    w13_bias: torch.Tensor | None  # bf16 [E, 2I]
    w2_bias: torch.Tensor | None  # bf16 [E, H]

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])

    def lists(self) -> dict[str, tuple[torch.Tensor, ...]]:
        out = {
            "w12": tuple(self.w13), "w3": tuple(self.w2),
            "d_scale_w12": tuple(self.w13_scale), "d_scale_w3": tuple(self.w2_scale),
        }
        if self.w13_bias is not None and self.w2_bias is not None:
            out["w12_bias"] = tuple(self.w13_bias)
            out["w3_bias"] = tuple(self.w2_bias)
        return out


def make_experts(num_experts: int, hidden: int, intermediate: int, *, bias: bool, seed: int,
                 scale_range: tuple[int, int] = (118, 122)) -> Experts:
    """Random valid MXFP4 experts; the scale range keeps activations well inside the SwiGLU clamp."""
    w13, w13_scale = random_mxfp4((num_experts, 2 * intermediate, hidden), seed=seed, scale_range=scale_range)
    w2, w2_scale = random_mxfp4((num_experts, hidden, intermediate), seed=seed + 1, scale_range=scale_range)
    g = torch.Generator().manual_seed(seed + 2)
    b13 = (torch.randn(num_experts, 2 * intermediate, generator=g) * 0.5).to(torch.bfloat16) if bias else None
    b2 = (torch.randn(num_experts, hidden, generator=g) * 0.5).to(torch.bfloat16) if bias else None
    return Experts(w13, w13_scale, w2, w2_scale, b13, b2)


def make_tokens(tokens: int, hidden: int, num_global: int, top_k: int, *, seed: int,
                id_low: int = 0, id_high: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 hidden states, distinct global expert ids per token (int32), bf16 routing weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    high = num_global if id_high is None else id_high
    ids = torch.stack([torch.randperm(high - id_low, generator=g)[:top_k] + id_low for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1).to(torch.bfloat16)
    return x, ids.to(torch.int32), weights


def oracle(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts, experts_min: int, *,
           activation: str = "swigluoai", alpha: float = DEFAULT_ALPHA, limit: float = DEFAULT_LIMIT) -> torch.Tensor:
    """Float64 evaluation from the definition: ``swigluoai`` is GPT-OSS's block
    (:func:`quantreg.models.gpt_oss_moe.moe_f64`, interleaved rows); other activations are the
    no-bias kernels' ``act(gate) * up`` on concatenated halves."""
    w13 = dequantize_mxfp4_f64(experts.w13, experts.w13_scale)
    w2 = dequantize_mxfp4_f64(experts.w2, experts.w2_scale)
    if activation == "swigluoai":
        return moe_f64(x, ids, weights, w13, w2, experts.w13_bias, experts.w2_bias, experts_min=experts_min,
                       alpha=alpha, limit=limit)
    act = {"silu": torch.nn.functional.silu, "relu": torch.relu,
           "gelu": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}[activation]
    xd = x.double()
    out = torch.zeros_like(xd)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot]) - experts_min
            if not 0 <= e < experts.num_experts:
                continue
            h = w13[e] @ xd[t]
            if experts.w13_bias is not None:
                h = h + experts.w13_bias[e].double()
            half = h.shape[0] // 2
            y = w2[e] @ (act(h[:half]) * h[half:])
            if experts.w2_bias is not None:
                y = y + experts.w2_bias[e].double()
            out[t] += float(weights[t, slot]) * y
    return out


rel_error = relative_error
"""max |out - ref| / max |ref|: quantreg's one measure (:func:`quantreg.error_measure.relative_error`)."""


def moe_config(*, num_global: int, num_local: int, top_k: int, hidden: int, intermediate: int, bias: bool,
               activation: str = "swigluoai", ep_rank: int = 0, dp_size: int = 1) -> Any:
    """A real vLLM FusedMoEConfig for a layer slice (EP rank ``ep_rank`` of ``num_global/num_local``)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    ep_size = num_global // num_local
    parallel = FusedMoEParallelConfig(
        tp_size=1, pcp_size=1, dp_size=dp_size, ep_size=ep_size, tp_rank=0, pcp_rank=0, dp_rank=0,
        ep_rank=ep_rank, sp_size=1, use_ep=ep_size > 1, all2all_backend="naive", enable_eplb=False,
    )
    return FusedMoEConfig(
        num_experts=num_global, experts_per_token=top_k, hidden_dim=hidden, intermediate_size=intermediate,
        num_local_experts=num_local, num_logical_experts=num_global, activation=MoEActivation(activation),
        device="cpu", routing_method=RoutingMethodType.Renormalize, moe_parallel_config=parallel,
        in_dtype=torch.bfloat16, has_bias=bias,
    )


class FakeLayer(torch.nn.Module):  # type: ignore[misc]  # torch is not followed (pyproject: follow_imports=skip)
    """The attributes vLLM's ``RoutedExperts`` gives a quant method, parameters made by the method.

    With ``experts``, they are loaded and ``process_weights_after_loading`` runs; with ``None``
    they are left as allocated and the caller drives the method (``bench/pwal_bench.py``).
    """

    def __init__(self, method: Any, config: Any, experts: Experts | None, *, use_grouped_topk: bool = False) -> None:
        super().__init__()
        self.moe_config = config
        self.local_num_experts = config.num_local_experts
        self.global_num_experts = config.num_experts
        self.top_k = config.experts_per_token
        self.activation = config.activation
        self.use_grouped_topk = use_grouped_topk
        self.custom_routing_function = None
        method.create_weights(self, num_experts=config.num_local_experts, hidden_size=config.hidden_dim,
                              intermediate_size_per_partition=config.intermediate_size_per_partition,
                              params_dtype=torch.bfloat16)
        self.quant_method = method
        if experts is None:
            return
        for param, source in (("w13_weight", experts.w13), ("w13_weight_scale", experts.w13_scale),
                              ("w2_weight", experts.w2), ("w2_weight_scale", experts.w2_scale)):
            getattr(self, param).data.copy_(source)
        if experts.w13_bias is not None:
            self.w13_bias.data.copy_(experts.w13_bias)
            self.w2_bias.data.copy_(experts.w2_bias)
        method.process_weights_after_loading(self)
