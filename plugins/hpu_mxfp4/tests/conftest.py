"""Test doubles for the Gaudi stack, installed per test and removed afterwards.

``hpu`` stands in for ``habana_frameworks.torch``, ``torch.hpu``, ``torch.ops.hpu.mixture_of_experts``
and ``torch.compile(backend="hpu_backend")``. Its kernels first assert the exact call contract
vllm-gaudi's MXFP4 method relies on, then compute with the pure-torch reference, so a method run
through them gives the reference's numbers. ``vllm_gaudi`` stands in for the two vllm-gaudi
modules the methods import lazily (DP dispatch, kernel chunk tuning). Everything goes through
``monkeypatch`` so nothing outlives its test.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from quantreg_hpu_mxfp4 import reference

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


@pytest.fixture
def hpu(monkeypatch: pytest.MonkeyPatch) -> HpuDoubles:
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


@pytest.fixture
def vllm_gaudi(monkeypatch: pytest.MonkeyPatch) -> GaudiDoubles:
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


TINY_GPT_OSS = """{"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64,
 "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
 "head_dim": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 128,
 "max_position_embeddings": 4096, "sliding_window": 128, "layer_types": ["full_attention"],
 "rope_theta": 150000, "torch_dtype": "bfloat16", "rope_scaling": {"rope_type": "yarn", "factor": 1.0,
 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false, "original_max_position_embeddings": 4096}}"""


@pytest.fixture(scope="session")
def gpt_oss_vllm_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real VllmConfig whose model is a tiny GPT-OSS config (no weights, no tokenizer, no network)."""
    from vllm.config import ModelConfig, VllmConfig

    model_dir: Path = tmp_path_factory.mktemp("tiny-gpt-oss")
    (model_dir / "config.json").write_text(TINY_GPT_OSS)
    return VllmConfig(model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16"))
