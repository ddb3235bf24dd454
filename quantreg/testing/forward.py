"""Checks on a real vLLM layer built with the method: its weights, and its output against the reference.

``weights`` (``create_weights`` registers what vLLM's GPT-OSS MXFP4 loader writes, and the writes
succeed), ``first-forward`` (a method that builds runs its first forward: what cannot run must
refuse in its constructor, where quantreg's seam contains the failure), ``forward-bias`` and
``forward-no-bias`` (outputs for 1, 7 and 64 tokens and top-k 1..4 within the declared tolerance
of the float64 reference, :mod:`quantreg.models.gpt_oss_moe`).
The machinery that turns many runs into one row (:func:`numeric`, :func:`layer_runs`) is shared
with :mod:`quantreg.testing.consistency`. torch and vLLM are imported when a check runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..problems import describe
from .context import Context, Outcome, fail

if TYPE_CHECKING:
    from ..models.gpt_oss_moe import GptOssMxfp4Experts
    from .diagnose import Case
    from .harness import MoeLayer

EP_SIZE = 2

Run = Callable[[], "tuple[float, str | None]"]
"""One forward compared with the reference: ``() -> (relative error, problem or None)``."""


def tokens_label(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def experts_for(ctx: Context, bias: bool, seed: int) -> GptOssMxfp4Experts:
    """Random valid experts in the run's layer shape (``ctx.shape``)."""
    from ..models.gpt_oss_moe import random_gpt_oss_mxfp4_experts

    shape = ctx.shape
    return random_gpt_oss_mxfp4_experts(shape.num_experts, shape.hidden, shape.intermediate, bias=bias, seed=seed)


def case_for(experts: GptOssMxfp4Experts, tokens: int, top_k: int, seed: int, layer: MoeLayer | None = None) -> Case:
    """Random inputs for ``experts``, seen from ``layer``'s EP rank when it has one."""
    from .diagnose import Case

    if layer is None or layer.ep_size == 1:
        return Case.random(experts, tokens, top_k, seed)
    return Case.random(experts, tokens, top_k, seed, experts_min=layer.experts_min,
                       num_local=layer.num_local_experts)


# -- weights ----------------------------------------------------------------------------------------


def weights(ctx: Context) -> None:
    shape = ctx.shape
    notes: list[str] = []
    for bias, ep_rank, ep_size in ((True, 0, 1), (False, 0, 1), (True, 1, EP_SIZE)):
        label = ("with biases" if bias else "without biases") + (
            f", EP rank {ep_rank} of {ep_size}" if ep_size > 1 else "")
        try:
            layer = ctx.harness.build(ctx.factory(), shape=shape, top_k=2, bias=bias, ep_size=ep_size,
                                      ep_rank=ep_rank)
        except Exception as exc:
            refused = ctx.refused_here(exc)
            if refused is not None:
                raise refused from exc
            raise
        notes += _check_parameters(layer, layer.local_slice(experts_for(ctx, bias, seed=7)), label)
    ctx.passed("w13_weight/_scale, w2_weight/_scale (uint8), w13_bias/w2_bias (float) registered and "
               "written by vLLM's loader, with and without biases and on EP rank 1 of 2"
               + (f"; padded beyond the loaded shape: {', '.join(dict.fromkeys(notes))}" if notes else ""))


def _check_parameters(layer: MoeLayer, local: GptOssMxfp4Experts, label: str) -> list[str]:
    """Fail unless the layer has the parameters the GPT-OSS loader writes and the writes succeed."""
    import torch

    params = layer.parameters()
    notes: list[str] = []
    n = layer.num_local_experts
    for name, tensor in local.tensors().items():
        param = params.get(name)
        if param is None:
            raise fail(f"{label}: no parameter '{name}', which vLLM's GPT-OSS MXFP4 loader writes "
                       f"(create_weights registered: {', '.join(sorted(params)) or 'nothing'})")
        blocks = name.endswith(("_weight", "_weight_scale"))
        if blocks and param.dtype != torch.uint8:
            raise fail(f"{label}: '{name}' is {param.dtype}; the loader copies uint8 MXFP4 "
                       f"{'scales' if name.endswith('scale') else 'blocks'} into it, and copy_ would convert "
                       "the bytes to numbers silently. Allocate uint8 and convert in process_weights_after_loading")
        if not blocks and not param.dtype.is_floating_point:
            raise fail(f"{label}: '{name}' is {param.dtype}; biases are bf16 in the checkpoint")
        want = tuple(tensor.shape)
        have = tuple(param.shape)
        if len(have) != len(want) or have[0] != n or any(h < w for h, w in zip(have[1:], want[1:])):
            raise fail(f"{label}: '{name}' has shape {list(have)}; the loader writes {list(want)} into "
                       f"param[:, :{want[1]}{', :' + str(want[2]) if len(want) > 2 else ''}] "
                       f"(first dim = the rank's {n} experts, the others at least the checkpoint's)")
        if have != want:
            notes.append(name)
        try:
            layer.load_parameter(name, tensor)
        except Exception as exc:
            raise fail(f"{label}: vLLM's loader could not write '{name}' {list(want)} into {list(have)}: "
                       f"{describe(exc, located=True)}") from exc
        if tuple(params[name].shape) != have or layer.parameters()[name] is not param:
            raise fail(f"{label}: loading replaced or reshaped '{name}'")
    return notes


# -- a build that succeeds survives its first forward ---------------------------------------------


def first_forward(ctx: Context) -> None:
    """Build the method as the seam does, load weights, run one forward: only its completing counts.

    Why a check of its own: quantreg's seam contains what a method raises while it is *built*
    (lenient: a WARNING and vLLM's own method; strict: one line), but nothing after -- a method
    that builds, loads, and raises at its first forward (a native library of another ABI
    version, a kernel missing for this CPU) stops vLLM's start-up in every mode. So whatever a
    method needs to run is checked in its constructor. The row names the stage that raised and
    where (``file:line``); the output's values are the numerical checks' business.
    """
    experts = experts_for(ctx, True, seed=5)
    stage = "building it (its constructor and create_weights, as the seam does)"
    try:
        layer = ctx.harness.build(ctx.factory(), shape=ctx.shape, top_k=2, bias=True)
        stage = "loading weights and process_weights_after_loading"
        layer.load(experts)
        layer.process()
    except Exception as exc:
        raise fail(f"'{ctx.method.name}' is available here ({ctx.availability.reason}) yet {stage} raised "
                   f"{describe(exc, located=True)}") from exc
    case = case_for(experts, 1, 2, seed=6, layer=layer)
    try:
        out = layer.forward(case.x, case.router_logits)
    except Exception as exc:
        raise fail(f"built and loaded, then its first forward (1 token, top-2) raised {describe(exc, located=True)}. "
                   "quantreg contains a failure while a method is built (lenient: vLLM's own method; strict: one "
                   "line), not at its first forward, where it stops vLLM: check what the method needs to run "
                   "(native library, ABI version, device kernel) in its constructor") from exc
    ctx.passed(f"built, loaded and ran 1 token, top-2: output {list(out.shape)} {str(out.dtype).replace('torch.', '')}")


# -- outputs against the reference ------------------------------------------------------------------


def compare(ctx: Context, out: Any, case: Case) -> tuple[float, str | None]:
    """(relative error, problem or None) of one output against the reference."""
    import torch

    from ..models.gpt_oss_moe import relative_error
    from .diagnose import explain

    tokens, hidden = case.x.shape
    if tuple(out.shape) != (tokens, hidden):
        return math.inf, f"output shape {tuple(out.shape)}, expected ({tokens}, {hidden})"
    if out.dtype != case.x.dtype:
        return math.inf, (f"output dtype {out.dtype} for {case.x.dtype} input; vLLM's runner (and its "
                          "torch.compile fake) expect the input's dtype")
    bad = int((~torch.isfinite(out)).sum())
    if bad:
        return math.inf, f"{bad} of {out.numel()} outputs are not finite (NaN/inf)"
    ref = case.reference()
    err = relative_error(out, ref)
    tolerance = ctx.tolerance
    if err > tolerance:
        return err, f"rel err {err:.3g} > {tolerance:g}. {explain(out, case, tolerance)}"
    return err, None


def numeric(ctx: Context, runs: Iterable[tuple[str, Run]], total_label: str) -> None:
    """Turn ``(label, run)`` pairs into the check's outcome: pass with the worst error, or fail
    with the worst run's problem and a list of the other failing runs."""
    failures: list[tuple[str, float, str]] = []
    worst = (-1.0, "")
    count = 0
    for label, run in runs:
        count += 1
        try:
            err, problem = run()
        except Outcome:
            raise
        except Exception as exc:
            failures.append((label, math.inf, f"raised {describe(exc, located=True)}"))
            continue
        if problem is not None:
            failures.append((label, err, problem))
        elif err > worst[0]:
            worst = (err, label)
    if failures:
        failures.sort(key=lambda f: -f[1] if math.isfinite(f[1]) else -1e300)
        finite = [f for f in failures if math.isfinite(f[1])]
        head_label, _, head_problem = finite[0] if finite else failures[0]
        head_problem = head_problem.rstrip(".") + "."
        if len({p for _, _, p in failures}) == 1 and len(failures) > 1:
            raise fail(f"{len(failures)} of {count} runs fail, all with: {head_problem}")
        others = [lbl + (f" (err {e:.2g})" if math.isfinite(e) else "") for lbl, e, _ in failures
                  if lbl != head_label]
        more = f" Other failing runs: {'; '.join(others[:4])}{'; ...' if len(others) > 4 else ''}" if others else ""
        raise fail(f"{len(failures)} of {count} runs fail; worst: {head_label}: {head_problem}{more}")
    ctx.passed(f"{count} runs ({total_label}); worst rel err {worst[0]:.1e} at {worst[1]}; "
               f"tolerance {ctx.tolerance:g}")


def layer_runs(ctx: Context, experts: GptOssMxfp4Experts, top_k: int, tokens: Sequence[int], seed: int,
               ep_rank: int = 0, ep_size: int = 1) -> Iterator[tuple[str, Run]]:
    """Build and load one layer, then yield one run per token count (build errors fail them all)."""
    where = f"EP rank {ep_rank}, " if ep_size > 1 else ""
    try:
        layer = ctx.harness.ready(ctx.factory(), experts, top_k=top_k, ep_size=ep_size, ep_rank=ep_rank)
    except Exception as exc:
        problem = f"building/loading/process_weights_after_loading raised {describe(exc, located=True)}"

        def failed() -> tuple[float, str | None]:
            return math.inf, problem

        for t in tokens:
            yield f"{where}{tokens_label(t)}, top-{top_k}", failed
        return
    for t in tokens:
        def run(t: int = t) -> tuple[float, str | None]:
            case = case_for(experts, t, top_k, seed + 10 * t, layer)
            return compare(ctx, layer.forward(case.x, case.router_logits), case)

        yield f"{where}{tokens_label(t)}, top-{top_k}", run


def _forward(ctx: Context, bias: bool) -> None:
    from .shapes import grid_for

    grid = grid_for(ctx.shape)
    experts = experts_for(ctx, bias, seed=100 if bias else 200)
    runs = (run for k in grid.top_ks for run in layer_runs(ctx, experts, k, grid.tokens, seed=1000 * k))
    ks = f"{grid.top_ks[0]}..{grid.top_ks[-1]}" if len(grid.top_ks) > 1 else str(grid.top_ks[0])
    numeric(ctx, runs, f"tokens {', '.join(map(str, grid.tokens))} x top-k {ks}"
                       + ("" if ctx.shape.small else f" at {ctx.shape.label()}"))


def forward_bias(ctx: Context) -> None:
    _forward(ctx, bias=True)


def forward_no_bias(ctx: Context) -> None:
    _forward(ctx, bias=False)
