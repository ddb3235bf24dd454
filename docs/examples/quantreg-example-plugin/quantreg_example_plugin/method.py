"""``example_mxfp4``: GPT-OSS MXFP4 experts, dequantised to bf16 once at load, computed in plain torch.

quantreg builds it as ``ExampleMxfp4MoEMethod(moe_config, **rule_options)`` inside vLLM's
``RoutedExperts._get_quant_method``. vLLM then calls, in order:

1. ``create_weights``: register the parameters vLLM's GPT-OSS MXFP4 loader writes (uint8 blocks
   and E8M0 scales, bf16 biases), each carrying vLLM's ``weight_loader``;
2. ``process_weights_after_loading``: here, decode MXFP4 to dense weights once;
3. ``apply`` for every forward, after vLLM's router chose ``topk_ids``/``topk_weights`` (the
   method is *modular*; a *monolithic* one would route itself in ``apply_monolithic``): one call
   of this plugin's torch custom op, so vLLM's default (compiled) mode records it as one opaque call.

Each step of the math is a small method, so the format's rules are easy to find (and a test can
break exactly one of them).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.utils import set_weight_attrs

from quantreg.formats.mxfp4 import BLOCK_SIZE, dequantize_mxfp4
from quantreg.models.gpt_oss import DEFAULT_ALPHA, DEFAULT_LIMIT

COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class ExampleMxfp4MoEMethod(FusedMoEMethodBase):  # type: ignore[misc]
    """GPT-OSS MoE (SwiGLU-OAI, interleaved gate/up, biases) on dequantised MXFP4 experts."""

    quantreg_format = "gpt_oss_mxfp4"  # the weights `quantreg check-method` feeds it
    quantreg_tolerance = 1e-2  # max |out - ref| / max |ref| against the float64 reference

    def __init__(self, moe: Any, compute_dtype: str = "bfloat16", **unknown: Any) -> None:
        if unknown:  # a misspelt rule option must not be ignored silently
            raise TypeError(f"example_mxfp4: unknown option(s) {', '.join(sorted(unknown))}; "
                            f"accepted: compute_dtype")
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"example_mxfp4: compute_dtype={compute_dtype!r} is not one of "
                             f"{', '.join(COMPUTE_DTYPES)}")
        super().__init__(moe)
        self.compute_dtype = COMPUTE_DTYPES[compute_dtype]
        self.alpha = moe.swiglu_alpha or DEFAULT_ALPHA  # GPT-OSS's constants unless the model sets them
        self.limit = moe.swiglu_limit or DEFAULT_LIMIT
        self.op_handle = next(_HANDLES)  # how this plugin's op finds this method (end of this file)
        _LIVE[self.op_handle] = self

    # -- 1. parameters, as vLLM's GPT-OSS MXFP4 loader expects them ---------------------------
    def create_weights(self, layer: Any, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        inter = intermediate_size_per_partition
        shapes = {
            "w13_weight": ((num_experts, 2 * inter, hidden_size // 2), torch.uint8),
            "w13_weight_scale": ((num_experts, 2 * inter, hidden_size // BLOCK_SIZE), torch.uint8),
            "w2_weight": ((num_experts, hidden_size, inter // 2), torch.uint8),
            "w2_weight_scale": ((num_experts, hidden_size, inter // BLOCK_SIZE), torch.uint8),
        }
        if self.moe.has_bias:
            shapes["w13_bias"] = ((num_experts, 2 * inter), torch.bfloat16)
            shapes["w2_bias"] = ((num_experts, hidden_size), torch.bfloat16)
        for name, (shape, dtype) in shapes.items():
            param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, extra_weight_attrs)  # carries vLLM's weight_loader

    # -- 2. after loading: decode once ---------------------------------------------------------
    def process_weights_after_loading(self, layer: Any) -> None:
        for name in ("w13", "w2"):
            blocks, scales = getattr(layer, f"{name}_weight"), getattr(layer, f"{name}_weight_scale")
            dense = self.dequantize(blocks.data, scales.data).to(self.compute_dtype)
            setattr(layer, f"{name}_weight", torch.nn.Parameter(dense, requires_grad=False))
            delattr(layer, f"{name}_weight_scale")  # the packed blocks and scales are freed

    def dequantize(self, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """uint8 blocks [E, N, K/2] + E8M0 scales [E, N, K/32] -> bf16 [E, N, K] (low nibble first)."""
        return dequantize_mxfp4(blocks, scales)

    def get_fused_moe_quant_config(self, layer: Any) -> None:
        return None  # no vLLM modular kernel: apply() computes everything itself

    # -- 3. forward: one call of this plugin's op (see the end of this file) ---------------------
    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts: Any = None, shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
        return EXPERTS_OP(x, topk_weights, self.local_expert_ids(layer, topk_ids), layer.w13_weight,
                          getattr(layer, "w13_bias", None), layer.w2_weight, getattr(layer, "w2_bias", None),
                          self.op_handle)

    def local_expert_ids(self, layer: Any, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's expert slots; -1 for experts another EP rank holds."""
        expert_map = layer.expert_map  # vLLM's global -> local map, None without expert parallelism
        return topk_ids.long() if expert_map is None else expert_map[topk_ids.long()].long()

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor,
                b13: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None) -> torch.Tensor:
        """The op's body: every routed (token, expert) pair, the expert's output times its routing weight."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(w13.shape[0]):
            token, k = (slots == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            y = self.expert(x[token], w13[e], None if b13 is None else b13[e], w2[e], None if b2 is None else b2[e])
            out.index_add_(0, token, y * topk_weights[token, k].float().unsqueeze(1))  # routing weight last
        return out.to(x.dtype)

    def expert(self, x: torch.Tensor, w13: torch.Tensor, b13: torch.Tensor | None, w2: torch.Tensor,
               b2: torch.Tensor | None) -> torch.Tensor:
        """One expert: w13 (+ bias) -> SwiGLU-OAI -> w2 (+ bias), in float32."""
        return self.linear(self.activation(self.linear(x, w13, b13)), w2, b2)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = (x.to(self.compute_dtype) @ weight.t()).float()
        return out if bias is None else out + bias.float()

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        """SwiGLU-OAI on interleaved rows: gate = 0::2, up = 1::2."""
        gate, up = self.gate_up(h)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(self.alpha * gate)

    def gate_up(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h[:, 0::2], h[:, 1::2]


# -- the experts behind a torch custom op ----------------------------------------------------------
# vLLM's default mode compiles the model (torch.compile, fullgraph, traced once for every batch
# size). `experts` reads how many tokens each expert got, which no trace can hold; behind a
# registered op with a fake (the output's shape and dtype) the compiler records one call, and eager
# mode calls the same op. The op finds its method by a handle (an int the trace keeps as a
# constant). `quantreg check-method` checks all of this ("compiled").
_LIVE: weakref.WeakValueDictionary[int, ExampleMxfp4MoEMethod] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def _experts_op(x: torch.Tensor, topk_weights: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor,
                b13: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None, handle: int) -> torch.Tensor:
    return _LIVE[handle].experts(x, topk_weights, slots, w13, b13, w2, b2)


def _output_like_x(x: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(x)


EXPERTS_OP: Any = torch.library.custom_op("quantreg_example_plugin::experts", _experts_op, mutates_args=())
EXPERTS_OP.register_fake(_output_like_x)
