"""The MoE method classes quantreg instantiates as ``cls(moe_config, **rule_options)``.

They subclass vLLM's ``GptOssMxfp4MoEMethod`` to keep its ``create_weights`` (uint8 MXFP4 blocks
and E8M0 scales, bf16 biases, the checkpoint loader's expectations) and replace everything that
runs: no CUDA backend is selected (:func:`quantreg.vllm.moe_method.init_without_backend`),
``process_weights_after_loading`` binds the loaded parameters (as views) to a
:class:`~.hpu_op.MoeOp`, and the forward routes tokens and calls it.

vLLM 0.32 calls ``apply_monolithic(layer, x, router_logits)`` when ``is_monolithic`` is true and
``apply(layer, x, topk_weights, topk_ids, ...)`` after its own router otherwise. Like vllm-gaudi,
the methods are monolithic and route inside (GPT-OSS: top-k of the logits, then softmax); a
layer with grouped top-k or a custom routing function switches the method to modular so vLLM's
router decides, because 0.32's ``RoutedExperts`` has no ``router`` for the method to call.

The in-method orders compute softmax + top-k only, so a layer whose vLLM router does more (hash
routing, a scoring function other than softmax, ``e_score_correction_bias``, a
``routed_scaling_factor`` on the weights, ``require_decomposed_backend``; see
:func:`.routing.unsupported_routing`) never gets them: ``routing: auto`` goes modular and vLLM's
router selects, an explicit ``topk_softmax``/``softmax_topk`` is refused with a ValueError naming
the layer and the feature. Built by quantreg's seam the check runs at build (the seam then falls
back or, strict, stops); built without a context, after loading.
"""

from __future__ import annotations

import logging
import os
from typing import Any, ClassVar

import torch

from quantreg import BuildContext
from quantreg.formats.mxfp4 import dequantize_mxfp4
from quantreg.vllm.moe_method import init_without_backend, upstream_mxfp4_method
from quantreg.vllm.routing import InMethodRouting

from . import routing, sequence_parallel
from .hpu_op import (
    ChunkPolicy,
    ExpertWeights,
    GatheredMoeOp,
    MoeOp,
    OpSet,
    hpu_ops,
    reference_ops,
    vllm_gaudi_chunk_policy,
)
from .options import MethodOptions

logger = logging.getLogger("vllm.quantreg.hpu_mxfp4")

NATIVE_ENV = "HPU_MXFP4_NATIVE"
_SUPPORTED_ACTIVATIONS = ("silu", "gelu", "relu")


_Base: type[Any] = upstream_mxfp4_method()


class HpuMxfp4MoEMethod(InMethodRouting, _Base):  # type: ignore[misc]
    """``hpu_mxfp4``: Gaudi's native MXFP4 MoE kernels on the packed weights."""

    quantreg_name: ClassVar[str] = "hpu_mxfp4"
    #: The bound this plugin guarantees against the float64 reference (tighter than quantreg's default).
    quantreg_tolerance: ClassVar[float] = 1e-2
    MXFP4_BLOCK_SIZE: ClassVar[int] = 32
    dequantize_at_load: ClassVar[bool] = False
    # vllm-gaudi's runner leaves the DP all-gather to the method; stock vLLM's runner does it itself.
    dispatch_across_dp: ClassVar[bool] = True
    #: The op the loaded experts are bound to (the gathered method binds :class:`~.hpu_op.GatheredMoeOp`).
    op_class: ClassVar[type[MoeOp]] = MoeOp

    def __init__(self, moe: Any, quantreg_context: BuildContext | None = None, **options: Any) -> None:
        """``cls(moe_config, **options)``; quantreg's seam also passes ``quantreg_context`` (the layer's key)."""
        self.method_options = MethodOptions.parse(self.quantreg_name, options)
        init_without_backend(self, moe)  # vLLM's create_weights, not its CUDA backend selection
        self.model_type = routing.model_type(quantreg_context)
        self._order = "vllm" if self.method_options.routing == "vllm" else "pending"
        layer = quantreg_context.layer if quantreg_context is not None else None
        self._decide_order(moe, layer, quantreg_context.prefix if quantreg_context is not None else "")
        self._activation = "silu"
        self._prepare_device()
        _explain_native_env(self.quantreg_name)

    def _decide_order(self, moe: Any, layer: Any, prefix: str) -> None:
        """Refuse, or defer to vLLM's router, routing the in-method orders do not compute.

        At build (quantreg passes the layer being constructed in its context) so a refusal reaches
        the seam, and again after loading for methods built without a context (the layer is known
        only then). ``auto`` goes modular; an explicit in-method order raises a ValueError.
        """
        self.defer_unsupported(self.quantreg_name, self.method_options.routing,
                               routing.unsupported_routing(moe, layer),
                               prefix or str(getattr(layer, "layer_name", "")), logger)

    # -- what runs where ------------------------------------------------------------------
    def _prepare_device(self) -> None:
        """Flush queued HPU work before weights are created, as vllm-gaudi's method does."""
        hpu: Any = getattr(torch, "hpu", None)
        if hpu is not None and hpu.is_available():
            hpu.synchronize()

    def _op_set(self) -> OpSet:
        return hpu_ops()

    def _chunk_policy(self, global_num_experts: int) -> ChunkPolicy:
        return vllm_gaudi_chunk_policy(global_num_experts)

    # -- load -------------------------------------------------------------------------------
    def process_weights_after_loading(self, layer: Any) -> None:
        """Bind the loaded parameters, one view per local expert, to the op (nothing is copied)."""
        num_local = int(layer.local_num_experts)
        experts_min = int(layer.moe_config.ep_rank) * num_local
        experts_max = experts_min + num_local - 1
        self._activation = routing.activation_name(layer.activation)
        w13_bias, w2_bias = self._biases(layer)
        self._decide_order(layer.moe_config, layer, "")
        if self._order == "pending":
            self._order = routing.order_for(self.method_options.routing, self.model_type, layer)
        w13, w2 = self._weights(layer, num_local, w13_bias, w2_bias)
        layer.moe_op = self.op_class(
            self._op_set(), w13, w2, experts_min, experts_max, mxfp4=not self.dequantize_at_load,
            alpha=self.method_options.alpha, limit=self.method_options.limit,
            chunks=self._chunk_policy(int(layer.global_num_experts)), max_experts_per_slice=self._slice_limit(),
        )

    def _slice_limit(self) -> int:
        """The MXFP4 kernels are never sliced (vllm-gaudi's MXFP4 op does not slice either)."""
        return 0

    def _biases(self, layer: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's biases; zeros for a bias-free SwiGLU-OAI layer (only the bias kernel has it)."""
        w13_bias = getattr(layer, "w13_bias", None)
        w2_bias = getattr(layer, "w2_bias", None)
        has_bias = w13_bias is not None and w2_bias is not None
        if self._activation == "swigluoai":
            if not has_bias:
                w13 = layer.w13_weight
                w13_bias = torch.zeros(w13.shape[0], w13.shape[1], dtype=torch.bfloat16, device=w13.device)
                w2_bias = torch.zeros(w13.shape[0], layer.w2_weight.shape[1], dtype=torch.bfloat16, device=w13.device)
            return _data(w13_bias), _data(w2_bias)
        if has_bias:
            raise ValueError(
                f"{self.quantreg_name}: the Gaudi bias kernels compute SwiGLU-OAI only, but this layer has "
                f"biases with activation '{self._activation}'"
            )
        if self._activation not in _SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"{self.quantreg_name}: activation '{self._activation}' is not supported by the Gaudi MoE "
                f"kernels (supported: swigluoai with interleaved gate/up, or {', '.join(_SUPPORTED_ACTIVATIONS)})"
            )
        return None, None

    def _weights(self, layer: Any, num_local: int, w13_bias: torch.Tensor | None,
                 w2_bias: torch.Tensor | None) -> tuple[ExpertWeights, ExpertWeights]:
        w13 = ExpertWeights.from_layer(layer.w13_weight.data, layer.w13_weight_scale.data, w13_bias, num_local)
        w2 = ExpertWeights.from_layer(layer.w2_weight.data, layer.w2_weight_scale.data, w2_bias, num_local)
        return w13, w2

    # -- forward ----------------------------------------------------------------------------
    def apply_monolithic(self, layer: Any, x: torch.Tensor, router_logits: torch.Tensor,
                         input_ids: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        """vLLM's monolithic entry: route here, then run the experts."""
        input_shape = x.shape
        x = x.view(-1, x.shape[-1])
        topk_weights, topk_ids = routing.select_experts(self._order, layer, x, router_logits)
        return self._run(layer, x, topk_weights, topk_ids, input_shape)

    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts: Any = None, shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
        """vLLM's modular entry: vLLM's router has already chosen the experts."""
        input_shape = x.shape
        return self._run(layer, x.view(-1, x.shape[-1]), topk_weights, topk_ids, input_shape)

    def _run(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             input_shape: torch.Size) -> torch.Tensor:
        topk_weights = topk_weights.to(x.dtype)
        topk_ids = topk_ids.to(torch.int32)  # the MXFP4 kernels take an int32 table
        gathered = self.dispatch_across_dp and layer.moe_config.dp_size > 1
        if gathered:
            x, topk_ids, topk_weights = routing.dispatch_across_dp(
                x, topk_ids, topk_weights, layer.moe_config.is_sequence_parallel)
        elif self.dispatch_across_dp and sequence_parallel.runner_skips_dispatch(layer.moe_config):
            gathered = True  # TP + EP with one DP rank under vllm-gaudi's fast-path runner
            x, topk_ids, topk_weights = sequence_parallel.gather(x, topk_ids, topk_weights)
        top_k = topk_ids.shape[-1]
        topk_ids = topk_ids.reshape(-1, top_k).to(torch.int32)
        topk_weights = topk_weights.reshape(-1, top_k)
        output: torch.Tensor = layer.moe_op(x, topk_ids, topk_weights, activation=self._activation)
        if gathered:
            return output.view(output.size(0), *input_shape[1:])
        return output.view(*input_shape)


class HpuMxfp4DequantMoEMethod(HpuMxfp4MoEMethod):
    """``hpu_mxfp4_dequant``: vllm-gaudi's ``HPU_MXFP4_NATIVE=0`` behaviour as a table choice.

    The MXFP4 parameters are decoded to bf16 once after loading (exactly, with
    :func:`quantreg.formats.mxfp4.dequantize_mxfp4`), replace the packed ones on the layer (the
    scales are dropped), and Gaudi's bf16 kernels run: 4x the weight memory of ``hpu_mxfp4``.
    """

    quantreg_name: ClassVar[str] = "hpu_mxfp4_dequant"
    dequantize_at_load: ClassVar[bool] = True

    def _weights(self, layer: Any, num_local: int, w13_bias: torch.Tensor | None,
                 w2_bias: torch.Tensor | None) -> tuple[ExpertWeights, ExpertWeights]:
        for name in ("w13", "w2"):
            packed = getattr(layer, f"{name}_weight")
            scale = getattr(layer, f"{name}_weight_scale")
            decoded = dequantize_mxfp4(packed.data, scale.data)
            setattr(layer, f"{name}_weight", torch.nn.Parameter(decoded, requires_grad=False))
            delattr(layer, f"{name}_weight_scale")
        w13 = ExpertWeights.from_layer(layer.w13_weight.data, None, w13_bias, num_local)
        w2 = ExpertWeights.from_layer(layer.w2_weight.data, None, w2_bias, num_local)
        return w13, w2

    def _slice_limit(self) -> int:
        """bf16 kernel calls take at most this many experts (0: all at once); see ``options``."""
        return self.method_options.experts_per_slice()

    def get_fused_moe_quant_config(self, layer: Any) -> Any:
        """The weights are plain bf16 now; describe them as unquantized (with biases if any)."""
        from vllm.model_executor.layers.fused_moe import config as moe_config

        w13_bias = getattr(layer, "w13_bias", None)
        w2_bias = getattr(layer, "w2_bias", None)
        if w13_bias is not None and w2_bias is not None:
            return moe_config.biased_moe_quant_config(w13_bias, w2_bias)
        return moe_config.FUSED_MOE_UNQUANTIZED_CONFIG


class HpuMxfp4GatheredMoEMethod(HpuMxfp4MoEMethod):
    """``hpu_mxfp4_gathered``: the fused MXFP4 kernel over one slot per routed (token, expert) pair.

    vllm-gaudi #1731's gathered path as a table choice: for small batches (decode) the kernel
    reads only the experts the batch routes to (:class:`~.hpu_op.GatheredMoeOp`); the table gives
    it the forwards up to a token bound and ``hpu_mxfp4`` the rest (``tokens: "<=16"`` /
    ``">16"`` for GPT-OSS's top-4: vllm-gaudi's ``tokens * top_k <= 64``). vllm-gaudi's
    ``moe_chunk`` tuning is for the fused op over every expert: not applied here.
    """

    quantreg_name: ClassVar[str] = "hpu_mxfp4_gathered"
    op_class: ClassVar[type[MoeOp]] = GatheredMoeOp

    def _chunk_policy(self, global_num_experts: int) -> ChunkPolicy:
        return ChunkPolicy()


class Mxfp4ReferenceMoEMethod(HpuMxfp4MoEMethod):
    """``mxfp4_reference``: the ``hpu_mxfp4`` method computed by :mod:`.reference`, on any device.

    It leaves DP gathering to vLLM's runner (stock vLLM dispatches before the method) and reads
    no vllm-gaudi tuning.
    """

    quantreg_name: ClassVar[str] = "mxfp4_reference"
    dispatch_across_dp: ClassVar[bool] = False

    def _prepare_device(self) -> None:
        return None

    def _op_set(self) -> OpSet:
        return reference_ops()

    def _chunk_policy(self, global_num_experts: int) -> ChunkPolicy:
        return ChunkPolicy()


def _data(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.data


_explained: set[str] = set()


def _explain_native_env(method: str) -> None:
    """Once per process and method: say what ``HPU_MXFP4_NATIVE`` would have chosen, and that the
    table chose instead. (vllm-gaudi's strip of the MXFP4 quant config follows the table too: the
    keeper in :mod:`.vllm_gaudi` keeps the config whenever the table picks a method of ours.)"""
    value = os.environ.get(NATIVE_ENV)
    if value is None or method in _explained:
        return
    _explained.add(method)
    would = ("vllm-gaudi's native MXFP4 kernel (HPUGptOssMxfp4MoEMethod)" if value == "1"
             else "dequantising MXFP4 to bf16 at load (vllm-gaudi's legacy path)")
    logger.info("%s=%s would select %s; quantreg's table decides here and chose '%s'",
                NATIVE_ENV, value, would, method)
