"""``CpuMxfp4MoEMethod``: the class quantreg instantiates as ``cls(moe_config, **rule_options)``.

It subclasses vLLM's ``GptOssMxfp4MoEMethod`` for its ``create_weights`` only (uint8 MXFP4 blocks
and E8M0 scales, bf16 biases, and the GPT-OSS and Mixtral loaders' expectations: both write into
these parameters, see quantreg's ``tests/e2e/test_second_arch.py``), and replaces everything that
runs:

* construction refuses where the kernel cannot run (:func:`.kernel.require`: the library loads,
  has this package's ABI version, and the CPU has AVX2+FMA), so a method that builds can run;
* construction skips the parent's CUDA backend selection
  (:func:`quantreg.vllm.moe_method.init_without_backend`: ``mxfp4_backend = None``); vLLM then
  rounds the intermediate size up to a multiple of 64 and zero-fills the padding, which this
  method computes through unchanged (zero rows and columns add exactly zero);
* ``process_weights_after_loading`` hands the loaded parameters to the kernel's
  :class:`~quantreg_cpu_mxfp4.kernel.PackedExperts` (which may repack them) and **frees** the
  layer's copies: the weights stay packed, no bf16 copy of the experts exists;
* the forward routes (GPT-OSS: top-k of the logits, softmax over k; others: softmax, top-k,
  renormalise), maps global expert ids to this expert-parallel rank's local ones
  (:func:`quantreg.vllm.routing.local_expert_ids`) and calls
  :func:`~quantreg_cpu_mxfp4.kernel.moe_forward`. All of it is tensor work Dynamo traces around
  one opaque custom op (``quantreg_cpu_mxfp4::moe_forward``), so vLLM's default mode (the model
  traced with ``fullgraph`` and compiled) runs the method as it runs eagerly.

Routing it does not compute is deferred to vLLM's router (``routing: auto``: the method goes
modular and ``apply`` gets vLLM's choice) or refused at build (an explicit in-method order), see
:mod:`.routing`.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch

from quantreg import BuildContext
from quantreg.vllm.moe_method import init_without_backend, upstream_mxfp4_method
from quantreg.vllm.routing import InMethodRouting, local_expert_ids

from . import kernel, routing
from .options import MethodOptions

logger = logging.getLogger("vllm.quantreg.cpu_mxfp4")

#: The parameters vLLM's loader filled and ``process_weights_after_loading`` hands to the kernel.
PACKED_PARAMETERS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")


_Base: type[Any] = upstream_mxfp4_method()


class CpuMxfp4MoEMethod(InMethodRouting, _Base):  # type: ignore[misc]
    """``cpu_mxfp4``: packed MXFP4 experts run by this distribution's CPU kernel."""

    quantreg_name: ClassVar[str] = "cpu_mxfp4"
    quantreg_format: ClassVar[str] = "gpt_oss_mxfp4"
    # What the kit holds it to (and prints): q8 activations reach 1.9 % on small clamped experts; the
    # default q8x2 measures ~0.3 % (its own tests hold that to 1 %). README.md quotes this value.
    quantreg_tolerance: ClassVar[float] = 0.02
    MXFP4_BLOCK_SIZE: ClassVar[int] = 32

    def __init__(self, moe: Any, quantreg_context: BuildContext | None = None, **options: Any) -> None:
        """``cls(moe_config, **options)``; quantreg's seam also passes ``quantreg_context`` (the layer's key).

        Raises unless the kernel loads here (:func:`.kernel.require`: library, ABI version, CPU): a
        failure now is the seam's to contain (lenient: a WARNING and vLLM's own method; strict: one
        line), one at the first forward would stop vLLM. The probe asks the same first, so a chain
        normally passes the method over before it is built."""
        self.method_options = MethodOptions.parse(self.quantreg_name, options)
        kernel.require()
        init_without_backend(self, moe)  # vLLM's create_weights, not its CUDA backend selection
        self.model_type = routing.model_type(quantreg_context)
        self._order = "vllm" if self.method_options.routing == "vllm" else "pending"
        self._activation = "swigluoai"
        self.w13: kernel.PackedExperts | None = None
        self.w2: kernel.PackedExperts | None = None
        self._w13_bias: torch.Tensor | None = None
        self._w2_bias: torch.Tensor | None = None
        layer = quantreg_context.layer if quantreg_context is not None else None
        self._decide_order(moe, layer, quantreg_context.prefix if quantreg_context is not None else "")

    def _decide_order(self, moe: Any, layer: Any, prefix: str) -> None:
        """Refuse (explicit in-method order) or defer to vLLM's router (``auto``) what routing does not compute.

        At build when quantreg passes the layer being built (so a refusal reaches the seam), and
        again after loading for methods built without a context.
        """
        self.defer_unsupported(self.quantreg_name, self.method_options.routing,
                               routing.unsupported_routing(moe, layer),
                               prefix or str(getattr(layer, "layer_name", "")), logger)

    # -- load -------------------------------------------------------------------------------
    def process_weights_after_loading(self, layer: Any) -> None:
        """Pack the loaded experts for the kernel and free the layer's MXFP4 parameters."""
        self._activation = routing.activation_name(layer.activation)
        self._decide_order(layer.moe_config, layer, "")
        if self._order == "pending":
            self._order = routing.order_for(self.method_options.routing, self.model_type,
                                            routing.unsupported_routing(layer.moe_config, layer))
        w13_bias = getattr(layer, "w13_bias", None)
        w2_bias = getattr(layer, "w2_bias", None)
        if (w13_bias is None) != (w2_bias is None):
            raise ValueError("cpu_mxfp4: the layer has only one of w13_bias / w2_bias")
        if w13_bias is not None and self._activation != "swigluoai":
            raise ValueError(f"cpu_mxfp4: biases with activation '{self._activation}' are not computed "
                             "(biases are GPT-OSS's, with swigluoai)")
        self.w13 = kernel.PackedExperts.from_vllm(layer.w13_weight.data, layer.w13_weight_scale.data)
        self.w2 = kernel.PackedExperts.from_vllm(layer.w2_weight.data, layer.w2_weight_scale.data)
        self._w13_bias = None if w13_bias is None else w13_bias.data
        self._w2_bias = None if w2_bias is None else w2_bias.data
        for name in PACKED_PARAMETERS:  # the kernel holds the experts now: drop the layer's references
            original = getattr(layer, name)
            setattr(layer, name, torch.nn.Parameter(torch.empty(0, dtype=original.dtype, device=original.device),
                                                    requires_grad=False))
        logger.debug("cpu_mxfp4: layer '%s': %d local experts packed (%d bytes), %s path",
                     getattr(layer, "layer_name", ""), self.w13.num_experts, self.w13.nbytes + self.w2.nbytes,
                     kernel.isa())

    def resident_bytes(self) -> int:
        """Bytes of expert weights this method keeps (packed weights and scales, biases)."""
        packed = sum(p.nbytes for p in (self.w13, self.w2) if p is not None)
        biases = sum(b.numel() * b.element_size() for b in (self._w13_bias, self._w2_bias) if b is not None)
        return int(packed + biases)

    # -- forward ----------------------------------------------------------------------------
    def apply_monolithic(self, layer: Any, x: torch.Tensor, router_logits: torch.Tensor,
                         input_ids: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        """vLLM's monolithic entry: route here, then run the experts."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = routing.select_experts(self._order, int(layer.top_k), router_logits.reshape(x.shape[0], -1))
        return self._run(layer, x, weights, ids).view(shape)

    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts: Any = None, shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
        """vLLM's modular entry: vLLM's router has already chosen the experts."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        return self._run(layer, x, topk_weights, topk_ids).view(shape)

    def _run(self, layer: Any, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.w13 is None or self.w2 is None:
            raise RuntimeError("cpu_mxfp4: forward before process_weights_after_loading")
        top_k = ids.shape[-1]
        ids = local_expert_ids(layer, ids.reshape(-1, top_k))
        return kernel.moe_forward(x.to(torch.bfloat16), ids, weights.reshape(-1, top_k).float(),
                                  self.w13, self._w13_bias, self.w2, self._w2_bias, activation=self._activation,
                                  alpha=self.method_options.alpha, limit=self.method_options.limit,
                                  precision=self.method_options.precision or None).to(x.dtype)
