"""The MoE op adapter: one layer's per-expert weights and the call into a fused MoE kernel.

This plays the part of vllm-gaudi's ``VllmMixtureOfExpertsOpMXFP4`` (and of its bf16
``VllmMixtureOfExpertsOp`` for the dequantised method). Where the kernels come from is
pluggable (:class:`OpSet`): :func:`hpu_ops` resolves ``torch.ops.hpu.mixture_of_experts.*`` and
compiles the MXFP4 calls through ``torch.compile(backend="hpu_backend")``, as the Gaudi MXFP4
kernels have no eager implementation; :func:`reference_ops` uses :mod:`.reference` unchanged.

Contract with the kernels (what the HPU test doubles assert):

* weights, scales and biases are tuples with one entry per **local** expert, views of the
  layer's parameters (no copies): MXFP4 weights uint8 ``[out, in/2]``, E8M0 scales uint8
  ``[out, in/32]``, biases bf16 ``[out]``; bf16 weights ``[out, in]``;
* ``experts_min``/``experts_max`` are the global ids of the first and last local expert;
* MXFP4 kernels take an int32 routing table, ``block_size=32``, ``permuted_weights=True``,
  ``is_fp4=True``; the bias kernel adds ``alpha``/``limit`` (SwiGLU-OAI), the plain one an
  activation name; the bf16 kernels take an int64 routing table (what vllm-gaudi feeds them);
* ``chunk_size``/``total_experts`` come from vllm-gaudi's ``moe_chunk``/``moe_token_boundary``
  tuning (0/0, the kernel's default, when there is none);
* bf16 kernels only: with ``max_experts_per_slice > 0`` and more local experts than that, the
  experts are cut into consecutive slices of at most that many; each slice is one kernel call
  with its own weights, biases and ``experts_min``/``experts_max`` (ids outside a slice
  contribute nothing), and the slice outputs are summed. Some Gaudi software releases (1.20)
  need at most 64 experts per call (vllm-gaudi's ``MAX_EXPERTS_PER_SLICE``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from quantreg.models.gpt_oss import DEFAULT_ALPHA, DEFAULT_LIMIT

BLOCK_SIZE = 32
Kernel = Callable[..., torch.Tensor]
Tensors = tuple[torch.Tensor, ...]


def _identity(fn: Kernel) -> Kernel:
    return fn


@dataclass(frozen=True)
class OpSet:
    """The four fused-MoE kernels and how the MXFP4 calls are to be wrapped."""

    name: str
    bias_mxfp4_fused_weights: Kernel
    mxfp4_fused_weights: Kernel
    bias_fused_weights: Kernel
    fused_weights: Kernel
    compile: Callable[[Kernel], Kernel] = _identity


def hpu_ops() -> OpSet:
    """Gaudi's kernels; imports the Habana bridge, which registers them and ``hpu_backend``."""
    try:
        importlib.import_module("habana_frameworks.torch")
    except ImportError as exc:
        raise RuntimeError(f"the Gaudi MoE kernels need habana_frameworks.torch: {exc}") from exc
    moe: Any = torch.ops.hpu.mixture_of_experts

    def compile_for_hpu(fn: Kernel) -> Kernel:
        compiled: Kernel = torch.compile(fn, backend="hpu_backend")
        return compiled

    return OpSet("hpu", moe.bias_mxfp4_fused_weights, moe.mxfp4_fused_weights, moe.bias_fused_weights,
                 moe.fused_weights, compile_for_hpu)


def reference_ops() -> OpSet:
    """The pure-torch reference, eager, each kernel behind a torch custom op (:mod:`.reference_ops`)
    so a compiled graph (vLLM's default mode) records one call, as for Gaudi's own kernels."""
    from . import reference_ops as ops

    return OpSet("reference", ops.bias_mxfp4_fused_weights, ops.mxfp4_fused_weights, ops.bias_fused_weights,
                 ops.fused_weights)


@dataclass(frozen=True)
class ChunkPolicy:
    """vllm-gaudi's kernel tuning: ``chunk_size`` by token count, plus the global expert count."""

    sizes: tuple[int, ...] = ()
    token_boundaries: tuple[int, ...] = ()
    total_experts: int = 0

    def for_tokens(self, tokens: int) -> tuple[int, int]:
        if not self.sizes:
            return 0, 0
        for size, boundary in zip(self.sizes, self.token_boundaries):
            if tokens <= boundary:
                return size, self.total_experts
        return self.sizes[-1], self.total_experts


def vllm_gaudi_chunk_policy(global_num_experts: int) -> ChunkPolicy:
    """Read ``moe_chunk``/``moe_token_boundary`` from vllm-gaudi's runtime config, if it is there."""
    try:
        runtime = importlib.import_module("vllm_gaudi.extension.runtime")
        config = runtime.get_config()
        sizes = tuple(int(x) for x in (getattr(config, "moe_chunk", None) or ()))
        bounds = tuple(int(x) for x in (getattr(config, "moe_token_boundary", None) or ()))
    except Exception:
        return ChunkPolicy()
    if len(sizes) != len(bounds):
        raise ValueError(f"vllm-gaudi moe_chunk {sizes} and moe_token_boundary {bounds} differ in length")
    return ChunkPolicy(sizes, bounds, global_num_experts if sizes else 0)


@dataclass
class ExpertWeights:
    """One projection's per-local-expert tensors (views of the layer's parameters)."""

    weight: tuple[torch.Tensor, ...]
    scale: tuple[torch.Tensor, ...] | None = None
    bias: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def from_layer(cls, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                   num_local: int) -> ExpertWeights:
        def split(t: torch.Tensor | None) -> tuple[torch.Tensor, ...] | None:
            return None if t is None else tuple(t[e] for e in range(num_local))

        views = split(weight)
        assert views is not None
        return cls(views, split(scale), split(bias))

    def narrow(self, start: int, end: int) -> ExpertWeights:
        """Local experts ``start..end-1`` (the same views)."""
        def part(values: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...] | None:
            return None if values is None else values[start:end]

        return ExpertWeights(self.weight[start:end], part(self.scale), part(self.bias))

    def pick(self, experts: Sequence[int]) -> ExpertWeights:
        """The views of local experts ``experts``, in that order, repeats included (the gathered slots)."""
        def part(values: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...] | None:
            return None if values is None else tuple(values[e] for e in experts)

        weight = part(self.weight)
        assert weight is not None
        return ExpertWeights(weight, part(self.scale), part(self.bias))


@dataclass
class MoeOp:
    """A layer's experts bound to a kernel set: ``op(x, ids, weights, activation=...)``.

    ``mxfp4`` selects the packed kernels (scales required) or the bf16 ones; a bias on both
    projections selects the SwiGLU-OAI ``bias_*`` kernels, otherwise the activation is named.
    """

    ops: OpSet
    w13: ExpertWeights
    w2: ExpertWeights
    experts_min: int
    experts_max: int
    mxfp4: bool
    alpha: float = DEFAULT_ALPHA
    limit: float = DEFAULT_LIMIT
    chunks: ChunkPolicy = field(default_factory=ChunkPolicy)
    max_experts_per_slice: int = 0
    _forward: Kernel | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        local = self.experts_max - self.experts_min + 1
        for name, part in (("w13", self.w13), ("w2", self.w2)):
            for kind in ("weight", "scale", "bias"):
                values: Sequence[torch.Tensor] | None = getattr(part, kind)
                if values is not None and len(values) != local:
                    raise ValueError(f"{name}.{kind} has {len(values)} experts, expected {local} "
                                     f"(experts {self.experts_min}..{self.experts_max})")
        if self.max_experts_per_slice < 0:
            raise ValueError(f"max_experts_per_slice must be >= 0 (0: no slicing), got {self.max_experts_per_slice}")
        if self.mxfp4 and (self.w13.scale is None or self.w2.scale is None):
            raise ValueError("MXFP4 kernels need the E8M0 scales of both projections")
        if (self.w13.bias is None) != (self.w2.bias is None):
            raise ValueError("the bias kernels need biases on both projections, or on neither")

    @property
    def has_bias(self) -> bool:
        return self.w13.bias is not None

    @property
    def num_local_experts(self) -> int:
        return len(self.w13.weight)

    def slices(self) -> list[tuple[int, int]]:
        """Local expert ranges ``[start, end)`` of each bf16 kernel call (one range: no slicing)."""
        local, most = self.num_local_experts, self.max_experts_per_slice
        if self.mxfp4 or most <= 0 or local <= most:
            return [(0, local)]
        return [(start, min(start + most, local)) for start in range(0, local, most)]

    def __call__(self, hidden_states: torch.Tensor, expert_routing_table: torch.Tensor,
                 router_weights: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        ranges = self.slices()
        if len(ranges) == 1:
            return self._call(self.w13, self.w2, self.experts_min, self.experts_max, hidden_states,
                              expert_routing_table, router_weights, activation)
        output: torch.Tensor | None = None
        for start, end in ranges:
            part = self._call(self.w13.narrow(start, end), self.w2.narrow(start, end), self.experts_min + start,
                              self.experts_min + end - 1, hidden_states, expert_routing_table, router_weights,
                              activation)
            output = part if output is None else output.add_(part)
        assert output is not None
        return output

    def _call(self, w13: ExpertWeights, w2: ExpertWeights, lo: int, hi: int, hidden_states: torch.Tensor,
              expert_routing_table: torch.Tensor, router_weights: torch.Tensor, activation: str) -> torch.Tensor:
        chunk_size, total_experts = self.chunks.for_tokens(hidden_states.shape[0])
        ids_dtype = torch.int32 if self.mxfp4 else torch.int64
        if expert_routing_table.dtype != ids_dtype:
            expert_routing_table = expert_routing_table.to(ids_dtype)
        if self._forward is None:
            self._forward = self._build()
        if self.mxfp4 and self.has_bias:
            return self._forward(hidden_states, expert_routing_table, router_weights, w13.weight, w2.weight,
                                 w13.bias, w2.bias, w13.scale, w2.scale, BLOCK_SIZE, lo, hi, chunk_size,
                                 total_experts, self.alpha, self.limit)
        if self.mxfp4:
            return self._forward(hidden_states, expert_routing_table, router_weights, w13.weight, w2.weight,
                                 w13.scale, w2.scale, BLOCK_SIZE, activation, lo, hi, chunk_size, total_experts)
        if self.has_bias:
            return self._forward(hidden_states, expert_routing_table, router_weights, w13.weight, w2.weight,
                                 w13.bias, w2.bias, lo, hi, chunk_size, total_experts, self.alpha, self.limit)
        return self._forward(hidden_states, expert_routing_table, router_weights, w13.weight, w2.weight,
                             activation, lo, hi, chunk_size, total_experts)

    def _build(self) -> Kernel:
        """This layer's kernel call, taking every tensor and scalar as an argument (as vllm-gaudi's
        compiled forwards do); the MXFP4 ones are wrapped by the op set's compiler once."""
        ops = self.ops
        if self.mxfp4 and self.has_bias:
            return ops.compile(_bias_mxfp4_call(ops.bias_mxfp4_fused_weights))
        if self.mxfp4:
            return ops.compile(_mxfp4_call(ops.mxfp4_fused_weights))
        if self.has_bias:
            return _bias_bf16_call(ops.bias_fused_weights)
        return _bf16_call(ops.fused_weights)


@dataclass
class GatheredMoeOp(MoeOp):
    """``hpu_mxfp4_gathered``'s op: one kernel slot per routed (token, expert) pair.

    For ``T`` tokens routed to ``top_k`` experts each, the fused MXFP4 kernel is called over
    ``T * top_k`` *slots*: slot ``t * top_k + k`` holds the views of the expert token ``t``'s
    ``k``-th choice (repeats allowed, nothing copied), and the routing table sends token ``t`` to
    its own ``top_k`` slots (``experts_min=0``, ``experts_max=T*top_k-1``); a choice outside this
    rank's experts (expert parallelism) gets slot id ``T*top_k``, outside the range, which the
    kernel skips. So the kernel reads only the weights a small batch routes to, where the fused op
    over every local expert reads all of them: the decode-time saving of vllm-gaudi #1731's
    gathered path (``tokens * top_k <= 64`` there). Above a few dozen slots one expert's weights
    are read once per slot that names it and the fused op wins: the table's ``tokens:`` bound
    says where (docs/gaudi-crossover.md).

    What it costs: one device-to-host read of the routing table per forward (the slot views are
    chosen on the host), and one compiled graph per slot count on Gaudi (``hpu_backend``
    recompiles for each bucketed token count, as for any shape). MXFP4 kernels only; never sliced.
    """

    def __call__(self, hidden_states: torch.Tensor, expert_routing_table: torch.Tensor,
                 router_weights: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        tokens, top_k = expert_routing_table.shape
        slots = tokens * top_k
        local = expert_routing_table.reshape(-1).to(torch.int64) - self.experts_min
        owned = (local >= 0) & (local < self.num_local_experts)
        picks = local.clamp(0, self.num_local_experts - 1).tolist()  # the one host read: views are chosen here
        table = torch.where(owned, torch.arange(slots, dtype=torch.int64, device=local.device),
                            torch.full_like(local, slots)).view(tokens, top_k)
        return self._call(self.w13.pick(picks), self.w2.pick(picks), 0, slots - 1, hidden_states, table,
                          router_weights, activation)


def _bias_mxfp4_call(kernel: Kernel) -> Kernel:
    def forward(hidden_states: torch.Tensor, expert_routing_table: torch.Tensor, router_weights: torch.Tensor,
                w12: Tensors, w3: Tensors, w12_bias: Tensors, w3_bias: Tensors, d_scale_w12: Tensors,
                d_scale_w3: Tensors, block_size: int, experts_min: int, experts_max: int, chunk_size: int,
                total_experts: int, alpha: float, limit: float) -> torch.Tensor:
        return kernel(hidden_states, expert_routing_table, router_weights, w12, w3, w12_bias, w3_bias,
                      d_scale_w12, d_scale_w3, block_size=block_size, permuted_weights=True,
                      experts_min=experts_min, experts_max=experts_max, is_fp4=True, chunk_size=chunk_size,
                      total_experts=total_experts, alpha=alpha, limit=limit)

    return forward


def _mxfp4_call(kernel: Kernel) -> Kernel:
    def forward(hidden_states: torch.Tensor, expert_routing_table: torch.Tensor, router_weights: torch.Tensor,
                w12: Tensors, w3: Tensors, d_scale_w12: Tensors, d_scale_w3: Tensors, block_size: int,
                activation: str, experts_min: int, experts_max: int, chunk_size: int,
                total_experts: int) -> torch.Tensor:
        return kernel(hidden_states, expert_routing_table, router_weights, w12, w3, d_scale_w12, d_scale_w3,
                      block_size=block_size, permuted_weights=True, activation=activation,
                      experts_min=experts_min, experts_max=experts_max, is_fp4=True, chunk_size=chunk_size,
                      total_experts=total_experts)

    return forward


def _bias_bf16_call(kernel: Kernel) -> Kernel:
    def forward(hidden_states: torch.Tensor, expert_routing_table: torch.Tensor, router_weights: torch.Tensor,
                w12: Tensors, w3: Tensors, w12_bias: Tensors, w3_bias: Tensors, experts_min: int,
                experts_max: int, chunk_size: int, total_experts: int, alpha: float,
                limit: float) -> torch.Tensor:
        return kernel(hidden_states, expert_routing_table, router_weights, w12, w3, w12_bias, w3_bias,
                      permuted_weights=True, experts_min=experts_min, experts_max=experts_max,
                      chunk_size=chunk_size, total_experts=total_experts, alpha=alpha, limit=limit)

    return forward


def _bf16_call(kernel: Kernel) -> Kernel:
    def forward(hidden_states: torch.Tensor, expert_routing_table: torch.Tensor, router_weights: torch.Tensor,
                w12: Tensors, w3: Tensors, activation: str, experts_min: int, experts_max: int,
                chunk_size: int, total_experts: int) -> torch.Tensor:
        return kernel(hidden_states, expert_routing_table, router_weights, w12, w3, permuted_weights=True,
                      activation=activation, experts_min=experts_min, experts_max=experts_max,
                      chunk_size=chunk_size, total_experts=total_experts)

    return forward
