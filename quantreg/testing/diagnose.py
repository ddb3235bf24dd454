"""Why an output differs: the classic mistakes of GPT-OSS MXFP4 methods, each as a float64 variant.

"Relative error 1.3" tells a plugin author that something is wrong, not what. Most real bugs
are one of a handful of misreadings of the format (nibble order, gate/up layout, where the w2
bias goes, the expert-parallel offset), and each misreading is itself a well-defined function.
So when a check fails, the method's output is compared with the reference computed *with that
mistake*; a variant that matches (within tolerance) names the bug and the fix.

Variants are built by transforming the reference's inputs wherever possible (a method that
reads gate/up as halves computes the true reference of re-interleaved weights), so they reuse
:func:`quantreg.models.gpt_oss_moe.moe_f64` rather than re-implementing it with a twist.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..models.gpt_oss_moe import (
    GptOssMxfp4Experts,
    random_hidden_states,
    random_router_logits,
    relative_error,
    route_topk_softmax,
)


@dataclass(frozen=True)
class Case:
    """One forward: the layer's experts (global), its inputs, and the rank's expert range."""

    experts: GptOssMxfp4Experts
    x: torch.Tensor
    router_logits: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    experts_min: int = 0
    num_local: int | None = None

    @classmethod
    def random(cls, experts: GptOssMxfp4Experts, tokens: int, top_k: int, seed: int, *, experts_min: int = 0,
               num_local: int | None = None) -> Case:
        """Random inputs for ``experts`` routed the GPT-OSS way (``seed`` for the states, ``seed + 1``
        for the logits), on the rank holding ``num_local`` experts from ``experts_min``."""
        x = random_hidden_states(tokens, experts.hidden, seed=seed)
        logits = random_router_logits(tokens, experts.num_experts, seed=seed + 1)
        weights, ids = route_topk_softmax(logits, top_k)
        return cls(experts, x, logits, ids, weights, experts_min, num_local)

    @property
    def local(self) -> GptOssMxfp4Experts:
        n = self.num_local if self.num_local is not None else self.experts.num_experts
        return self.experts.slice(self.experts_min, self.experts_min + n)

    def reference(self, experts: GptOssMxfp4Experts | None = None, *, topk_ids: torch.Tensor | None = None,
                  topk_weights: torch.Tensor | None = None, experts_min: int | None = None,
                  limit: float | None = None, activation: str | None = None) -> torch.Tensor:
        ex = experts if experts is not None else self.local
        kwargs: dict[str, Any] = {} if limit is None else {"limit": limit}
        if activation is not None:
            kwargs["activation"] = activation
        return routed_reference(ex, self.x, self.topk_ids if topk_ids is None else topk_ids,
                                self.topk_weights if topk_weights is None else topk_weights,
                                self.experts_min if experts_min is None else experts_min, **kwargs)


def routed_reference(experts: GptOssMxfp4Experts, x: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor, experts_min: int, **kwargs: Any) -> torch.Tensor:
    """The float64 reference, decoding only the routed experts, one at a time.

    Why: at real shapes a float64 copy of every expert is gigabytes (GPT-OSS-20B's layer: 6.4 GB);
    one expert at a time it is ~200 MB. The sum over experts is the same float64 math.
    """
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    local = topk_ids.long() - experts_min
    for e in torch.unique(local).tolist():
        if 0 <= e < experts.num_experts:
            out += experts.slice(e, e + 1).reference(x, topk_ids, topk_weights, experts_min=experts_min + e,
                                                     **kwargs)
    return out


Variant = Callable[[Case], "torch.Tensor | None"]


def _swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return (packed << 4) | (packed >> 4)


def _halves_as_interleaved(t: torch.Tensor) -> torch.Tensor:
    """Rows ``[gate; up]`` (halves) re-ordered so the interleaved reading sees the same gate and up."""
    half = t.shape[1] // 2
    out = torch.empty_like(t)
    out[:, 0::2], out[:, 1::2] = t[:, :half], t[:, half:]
    return out


def _swap_pairs(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t)
    out[:, 0::2], out[:, 1::2] = t[:, 1::2], t[:, 0::2]
    return out


def _nibbles(c: Case) -> torch.Tensor:
    ex = c.local
    return c.reference(replace(ex, w13_weight=_swap_nibbles(ex.w13_weight), w2_weight=_swap_nibbles(ex.w2_weight)))


def _concatenated(c: Case) -> torch.Tensor:
    ex = c.local
    return c.reference(replace(
        ex, w13_weight=_halves_as_interleaved(ex.w13_weight),
        w13_weight_scale=_halves_as_interleaved(ex.w13_weight_scale),
        w13_bias=None if ex.w13_bias is None else _halves_as_interleaved(ex.w13_bias)))


def _gate_up_swapped(c: Case) -> torch.Tensor:
    ex = c.local
    return c.reference(replace(
        ex, w13_weight=_swap_pairs(ex.w13_weight), w13_weight_scale=_swap_pairs(ex.w13_weight_scale),
        w13_bias=None if ex.w13_bias is None else _swap_pairs(ex.w13_bias)))


def _no_w2_bias(c: Case) -> torch.Tensor | None:
    return None if c.local.w2_bias is None else c.reference(replace(c.local, w2_bias=None))


def _no_w13_bias(c: Case) -> torch.Tensor | None:
    return None if c.local.w13_bias is None else c.reference(replace(c.local, w13_bias=None))


def _unweighted_w2_bias(c: Case) -> torch.Tensor | None:
    """w2 bias added once per routed expert, outside the routing weight."""
    ex = c.local
    if ex.w2_bias is None:
        return None
    out = c.reference(replace(ex, w2_bias=None))
    local = c.topk_ids.long() - c.experts_min
    for t in range(local.shape[0]):
        for s in range(local.shape[1]):
            e = int(local[t, s])
            if 0 <= e < ex.num_experts:
                out[t] += ex.w2_bias[e].double()
    return out


def _no_clamp(c: Case) -> torch.Tensor:
    return c.reference(limit=float("inf"))


def _silu(c: Case) -> torch.Tensor:
    return c.reference(activation="silu")


def _not_renormalised(c: Case) -> torch.Tensor:
    probs = torch.softmax(c.router_logits.double(), dim=-1)
    return c.reference(topk_weights=probs.gather(1, c.topk_ids.long()))


def _weights_ignored(c: Case) -> torch.Tensor:
    return c.reference(topk_weights=torch.ones_like(c.topk_weights))


def _scale_bias(delta: int) -> Variant:
    def shift(s: torch.Tensor) -> torch.Tensor:
        return (s.to(torch.int16) + delta).clamp(0, 254).to(torch.uint8)

    def variant(c: Case) -> torch.Tensor:
        ex = c.local
        return c.reference(replace(ex, w13_weight_scale=shift(ex.w13_weight_scale),
                                   w2_weight_scale=shift(ex.w2_weight_scale)))
    return variant


def _ep_no_offset(c: Case) -> torch.Tensor | None:
    """Global ids used as local slots: the rank's own weights, experts_min taken as 0."""
    return None if c.experts_min == 0 else c.reference(experts_min=0)


def _ep_wraps(c: Case) -> torch.Tensor | None:
    """Other ranks' ids not dropped: ``id - experts_min`` wraps (negative indexing) onto local slots."""
    n = c.local.num_experts
    if n == c.experts.num_experts:
        return None
    wrapped = c.experts_min + (c.topk_ids.long() - c.experts_min) % n
    return c.reference(topk_ids=wrapped)


#: (what the method does, what GPT-OSS MXFP4 requires instead, variant)
MISTAKES: tuple[tuple[str, str, Variant], ...] = (
    ("it decodes MXFP4 nibbles in the wrong order",
     "element 2j is the LOW nibble of byte j and element 2j+1 the high nibble", _nibbles),
    ("it reads w13 as concatenated halves [gate; up]",
     "GPT-OSS interleaves gate and up: gate = rows 0::2, up = rows 1::2", _concatenated),
    ("it swaps gate and up",
     "gate = rows 0::2 (clamped to max=limit), up = rows 1::2 (clamped to +-limit)", _gate_up_swapped),
    ("it ignores the w2 bias",
     "each expert adds w2_bias[e] to its output, before the routing weight", _no_w2_bias),
    ("it adds the w2 bias outside the routing weight",
     "w2_bias[e] is part of the expert's output and is scaled by the routing weight with it", _unweighted_w2_bias),
    ("it ignores the w13 bias",
     "w13_bias[e] is added to the gate/up pre-activations before SwiGLU", _no_w13_bias),
    ("it computes SiLU-and-mul, not SwiGLU-OAI (vLLM's fused_experts_cpu computes SiLU unless act_method "
     "says otherwise, since 0.33)",
     "GPT-OSS's activation is (clamp(u, -7, 7) + 1) * g * sigmoid(1.702 * g), g = clamp(gate, max=7); pass "
     "SwiGLU-OAI explicitly (quantreg.vllm.cpu_ops)", _silu),
    ("it does not clamp in SwiGLU",
     "gate = clamp(g, max=limit), up = clamp(u, -limit, limit) with limit 7.0", _no_clamp),
    ("its routing weights are not renormalised over the chosen experts",
     "GPT-OSS takes the softmax over the top-k logits (or softmax, top-k, renormalise)", _not_renormalised),
    ("it ignores the routing weights",
     "each expert's output is scaled by its routing weight", _weights_ignored),
    ("its E8M0 scales are one exponent too large",
     "scale byte b means 2**(b - 127)", _scale_bias(1)),
    ("its E8M0 scales are one exponent too small",
     "scale byte b means 2**(b - 127)", _scale_bias(-1)),
    ("it maps global expert ids to local slots without subtracting the rank's first expert",
     "on EP rank r the local slot is id - r * local_experts, and other ids are skipped", _ep_no_offset),
    ("it lets expert ids of other ranks wrap onto local experts",
     "routed ids outside this rank's range contribute nothing", _ep_wraps),
)


def explain(out: torch.Tensor, case: Case, tolerance: float) -> str:
    """A sentence naming the mistake whose variant ``out`` matches, or where the largest difference is."""
    ref = case.reference()
    actual = relative_error(out, ref)
    matches = []
    for what, rule, variant in MISTAKES:
        try:
            alt = variant(case)
        except Exception:  # a variant that does not apply to this case explains nothing
            continue
        if alt is None:
            continue
        err = relative_error(out, alt)
        if err <= max(2 * tolerance, 1e-12) and err < actual / 4:
            matches.append(f"{what} (its output matches that variant to {err:.1e}); {rule}")
    if matches:
        return "Likely cause: " + " -- or: ".join(matches) + "."
    return "No known mistake explains it; " + where(out, ref) + "."


def where(out: torch.Tensor, ref: torch.Tensor) -> str:
    """Where the largest difference is, with both values."""
    diff = (out.double() - ref).abs()
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, float("inf")))
    flat = int(diff.argmax())
    t, c = divmod(flat, diff.shape[1])
    return (f"largest difference at token {t}, hidden column {c}: got {float(out[t, c]):.4g}, "
            f"expected {float(ref[t, c]):.4g}")
