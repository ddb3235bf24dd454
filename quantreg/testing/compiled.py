"""The ``compiled`` check: the method runs inside ``torch.compile(fullgraph=True)`` and gives its eager output.

Why: vLLM's default mode (no ``--enforce-eager``) traces the model once with Dynamo, fullgraph, and
reuses the graph for every batch size. A method whose forward calls Python with side effects (a
ctypes library, a file check, a cache, a loop over data-dependent counts) breaks that trace, and a
Python branch on the token count is baked into it. quantreg's seams run every method they build
behind their own op (:mod:`quantreg.vllm.opaque`), so inside quantreg's seam such a method still
serves; this check holds the method's own contract, for every other caller (vLLM's own compiled
paths, a platform's compile backend such as vllm-gaudi's ``hpu_backend``, the method used without
quantreg): its kernel sits behind a registered torch custom op (``torch.library.custom_op`` with a
fake implementation giving the output's shape and dtype), and what is left traces.

The call compiled is the one vLLM's runner makes: ``apply_monolithic(layer=..., x=...,
router_logits=...)`` for a monolithic method, else ``apply(layer=..., x=..., topk_weights=...,
topk_ids=...)`` after vLLM's own router (kept outside, eager). The backend is ``aot_eager``: Dynamo's
trace and the fake implementations are what is checked (inductor adds code generation, not
traceability). The token dimension is dynamic, so one graph serves 1, 7 and 64 tokens; each output
must equal the eager call's within the method's tolerance. A trace failure is located: the file
and line of the method's code where the trace stopped.
"""

from __future__ import annotations

import re
import sysconfig
from typing import TYPE_CHECKING, Any

from .context import Context, fail
from .forward import case_for, experts_for

if TYPE_CHECKING:
    from .harness import MoeLayer

TOKENS = (1, 7, 64)
HINT = ("run the kernel (or the data-dependent Python) behind a torch custom op: torch.library.custom_op "
        "with register_fake giving the output's shape and dtype (docs/writing-a-plugin.md, 'vLLM's default mode')")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def where_trace_stopped(exc: BaseException) -> str:
    """``FILE:LINE (in FUNC)`` of the last user frame in a Dynamo error (torch's, the standard library's
    and this kit's frames skipped: the method's own line is the one to change), else ``""``. Dynamo
    prints the user frames it was tracing under ``from user code:``."""
    text = str(exc)
    stdlib = sysconfig.get_paths()["stdlib"]
    frames = [(f, ln, fn) for f, ln, fn in _FRAME.findall(text)
              if "/torch/" not in f and "/quantreg/testing/" not in f and not f.startswith(stdlib)]
    if not frames:
        return ""
    path, line, func = frames[-1]
    return f"{path}:{line} (in {func})"


def first_line(exc: BaseException) -> str:
    for line in str(exc).splitlines():
        line = line.strip()
        if line:
            return f"{type(exc).__name__}: {line[:300]}"
    return type(exc).__name__


def entry(layer: MoeLayer) -> tuple[Any, bool]:
    """The call vLLM's runner makes into the method, and whether it is the monolithic one."""
    method = layer.method
    if bool(getattr(method, "is_monolithic", False)):
        def monolithic(x: Any, router_logits: Any) -> Any:
            return method.apply_monolithic(layer=layer.experts, x=x, router_logits=router_logits)

        return monolithic, True

    def modular(x: Any, topk_weights: Any, topk_ids: Any) -> Any:
        return method.apply(layer=layer.experts, x=x, topk_weights=topk_weights, topk_ids=topk_ids)

    return modular, False


def compiled(ctx: Context) -> None:
    import torch
    from vllm.forward_context import set_forward_context

    experts = experts_for(ctx, bias=True, seed=600)
    layer = ctx.harness.ready(ctx.factory(), experts, top_k=2)
    call, monolithic = entry(layer)
    torch._dynamo.reset()  # a fresh cache: another method's graphs must not answer for this one
    fn = torch.compile(call, fullgraph=True, dynamic=True, backend="aot_eager")
    worst = 0.0
    for tokens in TOKENS:
        case = case_for(experts, tokens, 2, seed=6000 + tokens)
        with ctx.harness.context(), set_forward_context(None, ctx.harness.config), torch.no_grad():
            args: tuple[Any, ...]
            if monolithic:
                args = (case.x, case.router_logits)
            else:
                router = layer.runner.router
                weights, ids = router.select_experts(hidden_states=case.x, router_logits=case.router_logits)
                args = (case.x, weights, ids)
            eager = call(*(a.clone() for a in args))
            try:
                out = fn(*(a.clone() for a in args))
            except Exception as exc:
                where = where_trace_stopped(exc)
                raise fail(f"torch.compile(fullgraph=True) of {'apply_monolithic' if monolithic else 'apply'} "
                           f"failed at {tokens} token(s): {first_line(exc)}"
                           + (f" at {where}" if where else "") + f"; {HINT}") from None
        if not isinstance(out, torch.Tensor) or out.shape != eager.shape or out.dtype != eager.dtype:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise fail(f"compiled output {shape} differs in shape or dtype from eager {tuple(eager.shape)} "
                       f"{eager.dtype} at {tokens} token(s): check the op's fake implementation")
        scale = float(eager.double().abs().max()) or 1.0
        err = float((out.double() - eager.double()).abs().max()) / scale
        if err > ctx.tolerance:
            raise fail(f"compiled output differs from eager at {tokens} token(s): rel err {err:.3g} > "
                       f"{ctx.tolerance:g} (a branch baked into the trace?)")
        worst = max(worst, err)
    ctx.passed(f"{'apply_monolithic' if monolithic else 'apply'} under torch.compile(fullgraph=True, dynamic) "
               f"at {', '.join(map(str, TOKENS))} tokens equals eager (worst rel diff {worst:.1e})")
