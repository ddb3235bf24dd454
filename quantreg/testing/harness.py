"""Real vLLM MoE layers around a method under test: built, loaded and run the way vLLM does it.

Why not a fake layer: what breaks plugins in practice is the contract with vLLM itself (which
parameters ``create_weights`` must register for the GPT-OSS loader, what ``weight_loader`` does
with padding, how ``MoERunner`` calls a monolithic or a modular method, where expert parallelism
puts a rank's experts). So every layer here is made by vLLM's own ``FusedMoEFactory`` (0.26: the
same function named ``FusedMoE``, see :func:`quantreg.vllm.versions.moe_factory_v0_26`) under a
``VllmConfig`` whose model is a tiny GPT-OSS (``model_type: gpt_oss``, no weights, no tokenizer),
with the quantization config vLLM uses for GPT-OSS MXFP4 (``GptOssMxfp4Config``):

1. the method is built as ``cls(moe_config, **options)`` inside ``RoutedExperts._get_quant_method``,
   exactly what quantreg's seam does (the seam is replaced for the duration of the build only);
2. ``create_weights`` runs inside ``RoutedExperts.__init__`` as usual;
3. **load** hands each parameter's ``weight_loader`` the tensors vLLM's GPT-OSS MXFP4 loader hands
   it (``gpt_oss.py: _load_weights_mxfp4``), narrowed to the rank's experts under EP;
4. ``process_weights_after_loading`` is called as vLLM's model loader calls it;
5. the forward goes through ``MoERunner.forward`` in a forward context, under ``inference_mode``
   (as vLLM's model runner does; :func:`quantreg.formats.mxfp4.dequantize_mxfp4` works there at
   any size).

Expert parallelism without a process group: vLLM derives a layer's ``FusedMoEParallelConfig``
from the distributed state; the harness substitutes an explicit one (``ep_size``, ``ep_rank``,
no data parallelism) for the build, and asks the runner not to all-reduce the result, so one
process sees one rank's partial sum. Everything else (expert map, local expert count) is vLLM's.

This module imports torch and vLLM; :mod:`quantreg.testing` imports it only when checks run.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.fused_moe import layer as fused_moe_layer
from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from ..models.gpt_oss import tiny_gpt_oss_config
from ..models.gpt_oss_moe import GptOssMxfp4Experts
from ..vllm.versions import moe_factory_v0_26
from ..writing import fresh_directory, remove_tree, write_new
from .shapes import DEFAULT_SHAPE, MoeShape

MethodFactory = Callable[[Any], Any]
"""``moe_config -> method``: how the seam builds a method (``lambda cfg: cls(cfg, **options)``)."""

#: The tiny GPT-OSS whose config the harness's vLLM config reads (sizes of the layers are separate;
#: no quantization config: the harness hands vLLM's ``GptOssMxfp4Config`` to each layer itself).
TINY_GPT_OSS_CONFIG: dict[str, Any] = tiny_gpt_oss_config(
    hidden=64, intermediate=96, layers=1, experts=8, top_k=2, vocab=128, heads=2, kv_heads=1, head_dim=32,
    mxfp4=False)


class _Captured(Exception):
    def __init__(self, moe_config: Any) -> None:
        super().__init__("moe_config captured")
        self.moe_config = moe_config


@contextlib.contextmanager
def _seam(factory: MethodFactory) -> Iterator[None]:
    """``RoutedExperts._get_quant_method`` builds ``factory(moe_config)`` while the block runs."""
    saved = RoutedExperts.__dict__["_get_quant_method"]

    def get_quant_method(self: Any, prefix: str, quant_config: Any, moe_config: Any) -> Any:
        return factory(moe_config)

    RoutedExperts._get_quant_method = get_quant_method
    try:
        yield
    finally:
        RoutedExperts._get_quant_method = saved


@contextlib.contextmanager
def _expert_parallel(ep_size: int, ep_rank: int) -> Iterator[None]:
    """Layers built in the block are rank ``ep_rank`` of ``ep_size`` (no process group needed)."""
    if ep_size == 1:
        yield
        return
    saved = fused_moe_layer.make_parallel_config

    def make_parallel_config(**_: Any) -> Any:
        return FusedMoEParallelConfig(
            tp_size=1, pcp_size=1, dp_size=1, ep_size=ep_size, tp_rank=0, pcp_rank=0, dp_rank=0, ep_rank=ep_rank,
            sp_size=1, use_ep=True, all2all_backend="allgather_reducescatter", enable_eplb=False)

    fused_moe_layer.make_parallel_config = make_parallel_config
    try:
        yield
    finally:
        fused_moe_layer.make_parallel_config = saved


class MoeLayer:
    """One built layer: ``runner`` (vLLM's ``MoERunner``), ``experts`` (its ``RoutedExperts``), ``method``."""

    def __init__(self, harness: VllmMoeHarness, runner: Any, shape: MoeShape, top_k: int, bias: bool,
                 ep_size: int, ep_rank: int) -> None:
        self.harness = harness
        self.runner = runner
        self.experts: Any = runner.routed_experts
        self.method: Any = self.experts.quant_method
        self.shape = shape
        self.top_k = top_k
        self.bias = bias
        self.ep_size = ep_size
        self.ep_rank = ep_rank

    @property
    def num_local_experts(self) -> int:
        return int(self.experts.local_num_experts)

    @property
    def experts_min(self) -> int:
        """Global id of this rank's first expert (vLLM's linear placement)."""
        expert_map = self.experts.expert_map
        if expert_map is None:
            return 0
        return int((expert_map >= 0).nonzero()[0])

    def parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.experts.named_parameters())

    def load(self, experts: GptOssMxfp4Experts) -> None:
        """Write ``experts`` (all global experts) the way vLLM's GPT-OSS MXFP4 loader does.

        Under EP the loader narrows every tensor to the rank's experts (:meth:`local_slice`), then
        hands each to its parameter's loader (:meth:`load_parameter`).
        """
        for name, tensor in self.local_slice(experts).tensors().items():
            self.load_parameter(name, tensor)

    def local_slice(self, experts: GptOssMxfp4Experts) -> GptOssMxfp4Experts:
        """The experts this rank loads (all of them without EP)."""
        if self.ep_size == 1:
            return experts
        lo = self.experts_min
        return experts.slice(lo, lo + self.num_local_experts)

    def load_parameter(self, name: str, tensor: torch.Tensor) -> None:
        """``param.weight_loader(param, tensor, weight_name=..., shard_id=None, expert_id=None)``, as
        ``gpt_oss.py: _load_weights_mxfp4`` calls it (``default_weight_loader`` if the method set none)."""
        params = self.parameters()
        param = params.get(name)
        if param is None:
            raise LookupError(f"the layer has no parameter '{name}' for vLLM's GPT-OSS loader to write "
                              f"(parameters: {', '.join(sorted(params)) or 'none'})")
        loader = getattr(param, "weight_loader", default_weight_loader)
        if loader is default_weight_loader:
            loader(param, tensor)
        else:
            loader(param, tensor, weight_name=f"{self.experts.layer_name}.{name}", shard_id=None, expert_id=None)

    def process(self) -> None:
        """``process_weights_after_loading``, as vLLM's model loader calls it after loading."""
        with self.harness.context():
            self.method.process_weights_after_loading(self.experts)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``MoERunner.forward`` in a forward context; the output comes back on the CPU."""
        device = self.harness.device
        # no_grad, not inference_mode: dequantize_mxfp4's threaded path for big (real-size) tensors
        # writes into tensors made outside the block, which inference_mode refuses.
        with self.harness.context(), set_forward_context(None, self.harness.config), torch.no_grad():
            out: torch.Tensor = self.runner.forward(hidden_states.to(device), router_logits.to(device))
        return out.cpu()


class VllmMoeHarness:
    """A vLLM config of a tiny GPT-OSS and a factory of real MoE layers under it.

    ``device`` is where layers and inputs live; layers are built under ``torch.device(device)``,
    as vLLM's model loader builds models. Only ``cpu`` is exercised by quantreg's own tests.
    Use as a context manager (or call :meth:`close`) to remove the temporary model directory.
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._dir = fresh_directory("quantreg-testing-")
        write_new(self._dir / "config.json", json.dumps(TINY_GPT_OSS_CONFIG))
        self.config = VllmConfig(model_config=ModelConfig(model=str(self._dir), skip_tokenizer_init=True,
                                                          dtype="bfloat16"))
        self._ids = itertools.count()

    def close(self) -> None:
        remove_tree(self._dir)

    def __enter__(self) -> VllmMoeHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """The harness's vLLM config as the current one (methods may read it, e.g. the model type)."""
        with set_current_vllm_config(self.config):
            yield

    def _factory_kwargs(self, shape: MoeShape, top_k: int, bias: bool, ep_size: int) -> dict[str, Any]:
        """What vLLM's GPT-OSS ``MLPBlock`` passes to ``FusedMoEFactory`` (plus explicit sizes)."""
        return {
            "num_experts": shape.num_experts, "top_k": top_k, "hidden_size": shape.hidden,
            "intermediate_size": shape.intermediate, "params_dtype": torch.bfloat16, "renormalize": True,
            "quant_config": GptOssMxfp4Config(), "prefix": f"quantreg_testing.layers.{next(self._ids)}.mlp.experts",
            "apply_router_weight_on_input": False, "has_bias": bias, "activation": "swigluoai",
            "tp_size": 1, "dp_size": 1, "pcp_size": 1, "reduce_results": ep_size == 1,
        }

    def moe_config(self, *, shape: MoeShape = DEFAULT_SHAPE, top_k: int = 2, bias: bool = True, ep_size: int = 1,
                   ep_rank: int = 0) -> Any:
        """The ``FusedMoEConfig`` vLLM hands the seam for such a layer (captured, the layer is not built)."""

        def capture(moe_config: Any) -> Any:
            raise _Captured(moe_config)

        try:
            with self.context(), torch.device(self.device), _seam(capture), _expert_parallel(ep_size, ep_rank):
                moe_factory_v0_26(fused_moe_layer)(**self._factory_kwargs(shape, top_k, bias, ep_size))
        except _Captured as captured:
            return captured.moe_config
        raise RuntimeError("vLLM built a MoE layer without asking RoutedExperts._get_quant_method for its method")

    def build(self, factory: MethodFactory, *, shape: MoeShape = DEFAULT_SHAPE, top_k: int = 2, bias: bool = True,
              ep_size: int = 1, ep_rank: int = 0) -> MoeLayer:
        """A layer whose method is ``factory(moe_config)``; ``create_weights`` has run, nothing is loaded."""
        with self.context(), torch.device(self.device), _seam(factory), _expert_parallel(ep_size, ep_rank):
            runner = moe_factory_v0_26(fused_moe_layer)(**self._factory_kwargs(shape, top_k, bias, ep_size))
        return MoeLayer(self, runner, shape, top_k, bias, ep_size, ep_rank)

    def build_routed(self, *, routed_experts_cls: type[Any] | None = None, quant_config: Any = "gpt_oss_mxfp4",
                     shape: MoeShape = DEFAULT_SHAPE, top_k: int = 2, bias: bool = True,
                     **factory_kwargs: Any) -> MoeLayer:
        """A layer whose method ``RoutedExperts._get_quant_method`` chooses, unreplaced: vLLM's own, or
        quantreg's seam when it is installed (the seam's coverage tests build layers this way).

        ``routed_experts_cls`` is handed to ``FusedMoEFactory`` as a model does for its own
        ``RoutedExperts`` subclass; ``quant_config`` is vLLM's ``GptOssMxfp4Config`` by default
        (``None``: an unquantized layer); ``factory_kwargs`` override what GPT-OSS's block passes
        (e.g. ``scoring_func``, ``e_score_correction_bias``, ``routed_scaling_factor``).
        """
        kwargs = self._factory_kwargs(shape, top_k, bias, 1)
        kwargs["quant_config"] = GptOssMxfp4Config() if quant_config == "gpt_oss_mxfp4" else quant_config
        kwargs.update(factory_kwargs)
        if routed_experts_cls is not None:
            kwargs["routed_experts_cls"] = routed_experts_cls
        with self.context(), torch.device(self.device):
            runner = moe_factory_v0_26(fused_moe_layer)(**kwargs)
        return MoeLayer(self, runner, shape, top_k, bias, 1, 0)

    def ready(self, factory: MethodFactory, experts: GptOssMxfp4Experts, *, top_k: int,
              ep_size: int = 1, ep_rank: int = 0) -> MoeLayer:
        """build -> load ``experts`` -> ``process_weights_after_loading``: a layer ready to run."""
        shape = MoeShape(experts.num_experts, experts.hidden, experts.intermediate)
        layer = self.build(factory, shape=shape, top_k=top_k, bias=experts.has_bias, ep_size=ep_size,
                           ep_rank=ep_rank)
        layer.load(experts)
        layer.process()
        return layer


def method_factory(cls: type[Any], options: Mapping[str, Any] | None = None) -> MethodFactory:
    """The seam's construction: ``cls(moe_config, **options)``."""
    opts = dict(options or {})

    def build(moe_config: Any) -> Any:
        return cls(moe_config, **opts)

    return build
