"""Pure-torch reference of Gaudi's fused MoE kernels, with the names and argument order of
``torch.ops.hpu.mixture_of_experts.*`` as vllm-gaudi calls them.

Why it exists: the Gaudi kernels cannot run here, so this is the executable statement of what
they compute. It backs the ``mxfp4_reference`` method, serves as the "kernel" of the HPU test
doubles, and is what the tests compare with a float64 evaluation.

Semantics (the Habana bridge's own fallbacks and vllm-gaudi's use of the kernels):

* ``expert_routing_table`` holds **global** expert ids; the weight tuples hold the local experts
  ``experts_min..experts_max``. Local index = id - experts_min; ids outside the range add nothing.
* ``permuted_weights=True``: every weight is ``[out_features, in_features]`` (vLLM's layout), MXFP4
  ones packed along ``in_features`` with one E8M0 scale per 32 (see :mod:`quantreg.formats.mxfp4`).
* **Bias variants** (GPT-OSS): w12 rows are interleaved, gate = rows 0::2, up = rows 1::2, the w12
  bias is added first, then ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
  ``out = (up + 1) * gate * sigmoid(alpha * gate)``; the w3 bias is added per expert before the
  routing weight.
* **No-bias variants**: w12 is ``[gate; up]`` (concatenated halves), ``out = act(gate) * up``.

Numerics: weights are decoded exactly to bf16 (once per weight set, cached), matmuls run in bf16
with fp32 accumulation, activations and the weighted sum in fp32, the result in the dtype of
``hidden_states``; tests hold it to a relative error of 1e-2 against float64.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from quantreg.formats.mxfp4 import BLOCK_SIZE, dequantize_mxfp4
from quantreg.models.gpt_oss import DEFAULT_ALPHA, DEFAULT_LIMIT

Tensors = Sequence[torch.Tensor]
ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="tanh"),  # Gaudi's gelu kernel is the tanh form
    "relu": F.relu,
}
CACHE_ENV = "QUANTREG_MXFP4_REFERENCE_CACHE_MB"


class DequantCache:
    """Decoded bf16 weights, keyed by the identity and version of their packed source.

    The key is the source tensors' address, geometry and ``_version`` (bumped by in-place
    writes such as weight reloading); the entry keeps the sources alive, so an address cannot be
    reused by another tensor while its entry exists. Least recently used entries go first once
    ``max_bytes`` of decoded weights are held.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def key(weight: torch.Tensor, scale: torch.Tensor) -> tuple[object, ...]:
        return tuple(
            item
            for t in (weight, scale)
            for item in (t.data_ptr(), tuple(t.shape), t.stride(), t._version, t.device)
        )

    def get(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        key = self.key(weight, scale)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit[2]
        decoded = dequantize_mxfp4(weight, scale)
        size = decoded.numel() * decoded.element_size()
        with self._lock:
            self._entries[key] = (weight, scale, decoded)
            self._bytes += size
            while self._bytes > self.max_bytes and len(self._entries) > 1:
                _, (_, _, old) = self._entries.popitem(last=False)
                self._bytes -= old.numel() * old.element_size()
        return decoded

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)


CACHE = DequantCache(int(os.environ.get(CACHE_ENV, "8192")) << 20)


def bias_mxfp4_fused_weights(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w12: Tensors,
    w3: Tensors,
    w12_bias: Tensors,
    w3_bias: Tensors,
    d_scale_w12: Tensors,
    d_scale_w3: Tensors,
    *,
    block_size: int,
    permuted_weights: bool,
    experts_min: int,
    experts_max: int,
    alpha: float = DEFAULT_ALPHA,
    limit: float = DEFAULT_LIMIT,
    is_fp4: bool = True,
    chunk_size: int = 0,
    total_experts: int = 0,
) -> torch.Tensor:
    """GPT-OSS MoE (SwiGLU-OAI, biases) on packed MXFP4 weights."""
    _check_mxfp4(block_size, is_fp4)
    _check_experts(experts_min, experts_max, w12=w12, w3=w3, w12_bias=w12_bias, w3_bias=w3_bias,
                   d_scale_w12=d_scale_w12, d_scale_w3=d_scale_w3)
    return bias_fused_weights(
        hidden_states, expert_routing_table, router_weights,
        _LazyDecoded(w12, d_scale_w12), _LazyDecoded(w3, d_scale_w3), w12_bias, w3_bias,
        permuted_weights=permuted_weights, experts_min=experts_min, experts_max=experts_max,
        chunk_size=chunk_size, total_experts=total_experts, alpha=alpha, limit=limit,
    )


def mxfp4_fused_weights(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w12: Tensors,
    w3: Tensors,
    d_scale_w12: Tensors,
    d_scale_w3: Tensors,
    *,
    block_size: int,
    permuted_weights: bool,
    activation: str = "silu",
    experts_min: int,
    experts_max: int,
    is_fp4: bool = True,
    chunk_size: int = 0,
    total_experts: int = 0,
) -> torch.Tensor:
    """Gated MoE (``act(gate) * up`` over ``[gate; up]``) on packed MXFP4 weights, no biases."""
    _check_mxfp4(block_size, is_fp4)
    _check_experts(experts_min, experts_max, w12=w12, w3=w3, d_scale_w12=d_scale_w12, d_scale_w3=d_scale_w3)
    return fused_weights(
        hidden_states, expert_routing_table, router_weights,
        _LazyDecoded(w12, d_scale_w12), _LazyDecoded(w3, d_scale_w3),
        permuted_weights=permuted_weights, activation=activation, experts_min=experts_min,
        experts_max=experts_max, chunk_size=chunk_size, total_experts=total_experts,
    )


def bias_fused_weights(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w12: Tensors,
    w3: Tensors,
    w12_bias: Tensors,
    w3_bias: Tensors,
    *,
    permuted_weights: bool,
    experts_min: int,
    experts_max: int,
    chunk_size: int = 0,
    total_experts: int = 0,
    alpha: float = DEFAULT_ALPHA,
    limit: float = DEFAULT_LIMIT,
) -> torch.Tensor:
    """GPT-OSS MoE (SwiGLU-OAI, biases) on bf16 weights (``hpu::mixture_of_experts.bias_fused_weights``)."""
    _check_permuted(permuted_weights)
    _check_experts(experts_min, experts_max, w12=w12, w3=w3, w12_bias=w12_bias, w3_bias=w3_bias)

    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        h = _linear(x, w12[e], w12_bias[e])
        gate = h[:, 0::2].clamp(max=limit)
        up = h[:, 1::2].clamp(-limit, limit)
        glu = gate * torch.sigmoid(alpha * gate)  # before (up + 1): a huge negative gate gives -0, not inf*0
        return _linear(((up + 1) * glu).to(x.dtype), w3[e], w3_bias[e])

    return _moe(hidden_states, expert_routing_table, router_weights, experts_min, len(w12), expert)


def fused_weights(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w12: Tensors,
    w3: Tensors,
    *,
    permuted_weights: bool,
    activation: str = "silu",
    experts_min: int,
    experts_max: int,
    chunk_size: int = 0,
    total_experts: int = 0,
) -> torch.Tensor:
    """Gated MoE on bf16 weights (``hpu::mixture_of_experts.fused_weights``)."""
    _check_permuted(permuted_weights)
    _check_experts(experts_min, experts_max, w12=w12, w3=w3)
    act = ACTIVATIONS.get(activation)
    if act is None:
        raise ValueError(f"activation {activation!r} is not one of the kernel's: {', '.join(ACTIVATIONS)}")

    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        h = _linear(x, w12[e], None)
        half = h.shape[1] // 2
        return _linear((act(h[:, :half]) * h[:, half:]).to(x.dtype), w3[e], None)

    return _moe(hidden_states, expert_routing_table, router_weights, experts_min, len(w12), expert)


class _LazyDecoded(Sequence[torch.Tensor]):
    """Per-expert bf16 weights decoded on first use (only routed experts are ever decoded)."""

    def __init__(self, packed: Tensors, scales: Tensors) -> None:
        self._packed, self._scales = packed, scales

    def __len__(self) -> int:
        return len(self._packed)

    def __getitem__(self, index: int) -> torch.Tensor:  # type: ignore[override]
        return CACHE.get(self._packed[index], self._scales[index])


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in the weights' dtype with fp32 accumulation, returned as fp32."""
    out = (x.to(weight.dtype) @ weight.t()).float()
    return out if bias is None else out + bias.float()


def _moe(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    experts_min: int,
    num_local: int,
    expert: ExpertFn,
) -> torch.Tensor:
    """Gather the tokens of each routed local expert, run it, add its weighted output."""
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [tokens, hidden], got {tuple(hidden_states.shape)}")
    if expert_routing_table.shape != router_weights.shape or expert_routing_table.dim() != 2:
        raise ValueError(
            f"expert_routing_table {tuple(expert_routing_table.shape)} and router_weights "
            f"{tuple(router_weights.shape)} must both be [tokens, top_k]"
        )
    if expert_routing_table.shape[0] != hidden_states.shape[0]:
        raise ValueError("expert_routing_table and hidden_states disagree on the number of tokens")
    if expert_routing_table.dtype.is_floating_point:
        raise TypeError(f"expert_routing_table must hold integer ids, got {expert_routing_table.dtype}")
    top_k = expert_routing_table.shape[1]
    local = expert_routing_table.reshape(-1).long() - experts_min
    local = torch.where((local >= 0) & (local < num_local), local, num_local)  # num_local: "not here"
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=num_local + 1)[:num_local].tolist()
    weights = router_weights.reshape(-1).float()
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    start = 0
    for e, count in enumerate(counts):
        if count:
            picks = order[start:start + count]
            tokens = picks // top_k
            y = expert(e, hidden_states.index_select(0, tokens))
            out.index_add_(0, tokens, y * weights.index_select(0, picks).unsqueeze(1))
        start += count
    return out.to(hidden_states.dtype)


def _check_mxfp4(block_size: int, is_fp4: bool) -> None:
    if block_size != BLOCK_SIZE or not is_fp4:
        raise ValueError(f"only MXFP4 (is_fp4=True, block_size={BLOCK_SIZE}) is modelled, "
                         f"got is_fp4={is_fp4}, block_size={block_size}")


def _check_permuted(permuted_weights: bool) -> None:
    if not permuted_weights:
        raise NotImplementedError("only permuted_weights=True ([out, in] weights, as vLLM stores them) is modelled")


def _check_experts(experts_min: int, experts_max: int, **lists: Tensors) -> None:
    expected = experts_max - experts_min + 1
    if expected < 1:
        raise ValueError(f"empty expert range experts_min={experts_min}, experts_max={experts_max}")
    for name, values in lists.items():
        if len(values) != expected:
            raise ValueError(
                f"{name} has {len(values)} entries, but experts_min..experts_max = {experts_min}..{experts_max} "
                f"names {expected} local experts"
            )
