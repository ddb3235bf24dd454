"""Build, check and time every method that can run here, on real vLLM layers at a checkpoint's shapes.

Why the kit's harness: a method is judged where it will run, inside vLLM's own ``RoutedExperts`` /
``MoERunner`` (``create_weights``, vLLM's GPT-OSS loader's writes, ``process_weights_after_loading``,
the forward vLLM calls), never on a stand-in. vLLM's own method is built the same way (the
layer's method chosen by ``RoutedExperts._get_quant_method`` itself) wherever no limitation says
it cannot run here.

Correctness first, at every size timed: each built method runs :func:`check_tokens` inputs (1
and 5 tokens plus every count it times, :data:`~quantreg.tune.rank.DEFAULT_TOKENS` unless told, so a method right at one
token and wrong at 64 or 256, above plugin #2's 48-tokens-per-expert switch to its GEMM path, is
refused with the token count named) and is compared with the
float64 reference (:mod:`quantreg.models.gpt_oss_moe`), computed one routed expert at a time so a
20B-sized layer needs ~0.2 GB of float64 at once rather than 6 GB. A method further than the
tolerance (the ``verify:`` default, :data:`quantreg.table.verify.DEFAULT_TOLERANCE`) is refused,
as is one that fails to build or raises.

Timing: per token count (``tokens``: 1, 2, 4, ... 512 by default), every passing method runs the same
input; rounds are interleaved (method order rotated each round) so drift in the machine's load
hits every method alike, one warm-up round is discarded, and the median is kept; every timed
output is checked (shape, finite) outside the timed span. Rounds go on while the ``budget``
allows (at least :data:`.rounds.MIN_ROUNDS`, so each pair of methods has paired rounds to bound
the noise by; at most :data:`.rounds.MAX_ROUNDS`; the loop is :mod:`.rounds`, shared with the dense
measurement). The samples of every round are kept: the ranking
(:mod:`.rank`) separates two methods only beyond the noise they show, and :func:`.rank.sanity`
flags time that falls with token count and outlier rounds.

Imports torch and vLLM (through the kit).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..keys import Key
from ..methods import VLLM_METHOD, BuildContext, construct, keeps_vllm
from ..models.checkpoint import read_tensors
from ..models.gpt_oss_moe import (
    GptOssMxfp4Experts,
    moe_f64,
    random_gpt_oss_mxfp4_experts,
    random_hidden_states,
    random_router_logits,
    relative_error,
    route_topk_softmax,
)
from ..problems import printable
from ..registry import Registry
from ..testing.harness import MoeLayer, VllmMoeHarness
from ..vllm.platform import fused_moe_method_base
from .rank import DEFAULT_TOKENS, TOKENS, Result
from .rounds import Progress
from .side_by_side import SideBySide


def check_tokens(tokens: Sequence[int] = DEFAULT_TOKENS) -> tuple[int, ...]:
    """The counts checked against float64 when ``tokens`` are timed: those, 5 and the score's counts."""
    return tuple(sorted({1, 5, *TOKENS, *tokens}))


CHECK_TOKENS = check_tokens()
"""Token counts checked against the float64 reference by default: every count timed, and 5 (an odd decode batch).

The check routes to :func:`routed_subset` (``2 * top_k`` experts), so at 256 tokens each routed
expert gets ~128 rows: above plugin #2's GEMM switch (48 per expert); at 64, ~32: below it."""
SEED = 1234


@dataclass(frozen=True)
class LayerShape:
    experts: int
    hidden: int
    intermediate: int
    top_k: int

    def as_json(self) -> dict[str, int]:
        return {"experts": self.experts, "hidden": self.hidden, "intermediate": self.intermediate, "top_k": self.top_k}


def synthetic_experts(shape: LayerShape, seed: int = SEED) -> GptOssMxfp4Experts:
    """Valid random MXFP4 experts (with biases) of ``shape``: what ``--synthetic`` measures."""
    return random_gpt_oss_mxfp4_experts(shape.experts, shape.hidden, shape.intermediate, bias=True, seed=seed)


def checkpoint_experts(model_dir: str | Path, layer: int) -> GptOssMxfp4Experts:
    """Layer ``layer``'s experts as vLLM's GPT-OSS MXFP4 loader hands them to the parameters.

    Reads only that layer's eight expert tensors from the safetensors files (``*_blocks``
    ``[E, N, K/32, 16]`` viewed as ``[E, N, K/2]``, ``*_scales``, ``*_bias``).
    """
    prefix = f"model.layers.{layer}.mlp.experts."
    names = {"w13_weight": "gate_up_proj_blocks", "w13_weight_scale": "gate_up_proj_scales",
             "w13_bias": "gate_up_proj_bias", "w2_weight": "down_proj_blocks", "w2_weight_scale": "down_proj_scales",
             "w2_bias": "down_proj_bias"}
    read = read_tensors(model_dir, [prefix + n for n in names.values()], hint=" (is it GPT-OSS MXFP4?)")
    found: dict[str, torch.Tensor] = {}
    for ours, theirs in names.items():
        tensor = read[prefix + theirs]
        if theirs.endswith("_blocks"):
            tensor = tensor.reshape(tensor.shape[0], tensor.shape[1], -1)
        found[ours] = tensor.contiguous()
    return GptOssMxfp4Experts(**found)


def routed_subset(num_experts: int, top_k: int) -> list[int]:
    """The experts the correctness inputs route to: ``2 * top_k`` of them, spread over the layer.

    Why a subset: the float64 reference decodes every routed expert exactly (a 20B expert is
    ~25 M values); bounding the distinct experts bounds the check's cost at any layer size,
    while first, middle and last experts are still covered (expert-order mistakes show).
    """
    count = min(num_experts, 2 * top_k)
    return sorted({round(i * (num_experts - 1) / max(count - 1, 1)) for i in range(count)})


def restrict_routing(logits: torch.Tensor, experts: Sequence[int]) -> torch.Tensor:
    """``logits`` with every expert outside ``experts`` pushed below all of them (exact in bf16)."""
    out = logits.clone()
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
    keep[list(experts)] = True
    floor = float(logits.float().min()) - 8.0
    out[:, ~keep] = floor
    return out


def reference(experts: GptOssMxfp4Experts, x: torch.Tensor, logits: torch.Tensor, top_k: int,
              dense: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
    """The float64 MoE output, one routed expert at a time (bounded memory at any layer size).

    ``dense`` caches each expert's exact float64 decode across calls (the check's cases share experts).
    """
    weights, ids = route_topk_softmax(logits, top_k)
    out = torch.zeros(x.shape, dtype=torch.float64)
    cache = {} if dense is None else dense
    for e in sorted(set(ids.flatten().tolist())):
        one = experts.slice(e, e + 1)
        if e not in cache:
            cache[e] = one.dense_f64()
        w13, w2 = cache[e]
        out += moe_f64(x, ids, weights, w13, w2, one.w13_bias, one.w2_bias, experts_min=e)
    return out


class Measurement(SideBySide):
    """The methods of one key, built once on real vLLM MoE layers, then checked and timed side by side."""

    def __init__(self, registry: Registry, key: Key, experts: GptOssMxfp4Experts, top_k: int, *,
                 tolerance: float, progress: Progress, tokens: Sequence[int] = DEFAULT_TOKENS) -> None:
        super().__init__(registry, key, progress)
        self.experts = experts
        self.top_k = top_k
        self.tolerance = tolerance
        self.tokens = tuple(sorted({*TOKENS, *tokens}))  # the score's counts always: every method needs them
        self.layers: dict[str, MoeLayer] = {}

    def candidates(self) -> list[str]:
        """Every registered method, vLLM's own included, sorted by name (those that cannot run here too)."""
        return sorted({*self.registry.methods, VLLM_METHOD})

    def build(self, harness: VllmMoeHarness, name: str) -> MoeLayer:
        """``name``'s layer: vLLM's own ``RoutedExperts`` for ``vllm``, else the method built by the kit's harness."""
        e = self.experts
        if keeps_vllm(name):
            layer = harness.build_routed(shape=_moe_shape(e), top_k=self.top_k, bias=e.has_bias)
            layer.load(e)
            layer.process()
            return layer
        cls = self.registry.methods[name].load(base=fused_moe_method_base())
        context = BuildContext(self.key, name, "quantreg tune")

        def factory(moe_config: Any) -> Any:
            return construct(cls, moe_config, context)

        return harness.ready(factory, e, top_k=self.top_k)

    def check_all(self) -> None:
        """Compare each built method with the float64 reference; refuse those outside the tolerance."""
        cases = []
        routed = routed_subset(self.experts.num_experts, self.top_k)
        dense: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for tokens in check_tokens(self.tokens):
            x = random_hidden_states(tokens, self.experts.hidden, seed=SEED + tokens)
            logits = restrict_routing(
                random_router_logits(tokens, self.experts.num_experts, seed=SEED + 100 + tokens), routed)
            cases.append((tokens, x, logits, reference(self.experts, x, logits, self.top_k, dense)))
        dense.clear()
        for i, (name, layer) in enumerate(sorted(self.layers.items())):
            self.progress(f"{self.key}: check {name} against float64", i / max(len(self.layers), 1))
            result = self.results[name]
            worst = 0.0
            for tokens, x, logits, ref in cases:
                self.progress(f"{self.key}: check {name} at {tokens} token{'s' if tokens != 1 else ''} "
                              "against float64", i / max(len(self.layers), 1), detail=True)
                out, error = self.run(name, tokens, functools.partial(layer.forward, x, logits))
                error = error or output_problem(out, x)
                if error is not None:
                    result.error = f"forward at {tokens} token{'s' if tokens != 1 else ''}: {error}"
                    break
                err = relative_error(out, ref)
                worst = max(worst, err)
                if not err <= self.tolerance:
                    result.error = (f"numerics: relative error {err:.3g} > tolerance {self.tolerance:g} "
                                    f"at {tokens} token{'s' if tokens != 1 else ''} (float64 reference)")
                    break
            result.rel_error = worst
            result.ok = result.error is None
        self.drop_refused()

    def time_all(self, deadline: float, tokens: Sequence[int] | None = None) -> int:
        """Interleaved timing rounds until ``deadline`` (``time.monotonic()``); returns the rounds measured."""
        tokens = self.tokens if tokens is None else tokens
        names = sorted(self.layers)
        if not names:
            return 0
        inputs = {t: (random_hidden_states(t, self.experts.hidden, seed=SEED + 7 * t),
                      random_router_logits(t, self.experts.num_experts, seed=SEED + 11 * t)) for t in tokens}

        def forward(name: str, t: int) -> Any:
            return self.layers[name].forward(*inputs[t])

        return self.time_rounds(names, tokens, deadline, forward, lambda out, t: output_problem(out, inputs[t][0]))


def output_problem(out: Any, x: torch.Tensor) -> str | None:
    """Why a forward's ``out`` is not the MoE output for ``x`` (``None`` if it is): a tensor of
    ``x``'s shape. Checked before any comparison, because broadcasting would compare a ``[1, H]``
    answer with every row of the reference."""
    if not isinstance(out, torch.Tensor):
        return f"returned {printable(type(out).__name__)}, expected a tensor of shape {list(x.shape)}"
    if tuple(out.shape) != tuple(x.shape):
        return f"returned shape {list(out.shape)}, expected {list(x.shape)}"
    if not (out.is_floating_point()):
        return f"returned dtype {out.dtype}, expected a floating-point tensor"
    if not bool(torch.isfinite(out).all()):
        bad = int((~torch.isfinite(out)).sum())
        return f"returned {bad} non-finite value{'s' if bad != 1 else ''} (NaN or inf) of {out.numel()}"
    return None


def _moe_shape(experts: GptOssMxfp4Experts) -> Any:
    from ..testing.shapes import MoeShape

    return MoeShape(experts.num_experts, experts.hidden, experts.intermediate)


def measure(registry: Registry, key: Key, experts: GptOssMxfp4Experts, top_k: int, *, tolerance: float,
            deadline: float, progress: Progress, tokens: Sequence[int] = DEFAULT_TOKENS) -> tuple[list[Result], int]:
    """All methods for ``key``: built, checked, timed at ``tokens`` until ``deadline``. Returns results and rounds."""
    m = Measurement(registry, key, experts, top_k, tolerance=tolerance, progress=progress, tokens=tokens)
    try:
        with VllmMoeHarness("cpu") as harness:
            m.build_all(functools.partial(m.build, harness))
            m.check_all()
            rounds = m.time_all(deadline)
    finally:
        m.close()
    return [m.results[n] for n in sorted(m.results)], rounds
