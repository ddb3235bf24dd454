"""Checks that the method agrees with itself: split over expert-parallel ranks, and run again.

``expert-parallel``: ranks 0 and 1 of 2 each give the partial sum of their own experts (the
reference restricted to the rank's expert range); ``deterministic``: identical inputs give
bit-identical outputs on the same layer (with another call in between) and on a second layer
loaded with the same weights. torch and vLLM are imported when a check runs.
"""

from __future__ import annotations

from .context import Context, fail
from .forward import EP_SIZE, case_for, experts_for, layer_runs, numeric


def expert_parallel(ctx: Context) -> None:
    from .shapes import grid_for

    grid = grid_for(ctx.shape)
    experts = experts_for(ctx, bias=True, seed=300)
    runs = (run for rank in range(EP_SIZE) for k in grid.ep_top_ks
            for run in layer_runs(ctx, experts, k, grid.ep_tokens, seed=3000 + 100 * k, ep_rank=rank,
                                  ep_size=EP_SIZE))
    numeric(ctx, runs, f"ranks 0 and 1 of {EP_SIZE} x tokens {', '.join(map(str, grid.ep_tokens))} x "
                       f"top-k {', '.join(map(str, grid.ep_top_ks))}, biases on")


def deterministic(ctx: Context) -> None:
    import torch

    experts = experts_for(ctx, bias=True, seed=400)
    first = ctx.harness.ready(ctx.factory(), experts, top_k=2)
    case = case_for(experts, 64, 2, seed=4000)
    other = case_for(experts, 7, 2, seed=4100)
    a = first.forward(case.x.clone(), case.router_logits.clone())
    first.forward(other.x, other.router_logits)
    b = first.forward(case.x.clone(), case.router_logits.clone())
    if not torch.equal(a, b):
        raise fail(f"two calls on the same layer with identical inputs differ (max |diff| "
                   f"{float((a.double() - b.double()).abs().max()):.3g}, another call in between); "
                   "look for state kept between calls or non-deterministic reductions")
    second = ctx.harness.ready(ctx.factory(), experts, top_k=2)
    c = second.forward(case.x.clone(), case.router_logits.clone())
    if not torch.equal(a, c):
        raise fail(f"a second layer loaded with the same weights gives a different output (max |diff| "
                   f"{float((a.double() - c.double()).abs().max()):.3g}); look for state shared between "
                   "layers or depending on load order")
    ctx.passed("64 tokens, top-2, biases: same layer twice (another call in between) and a second "
               "layer with the same weights give bit-identical outputs")
