"""The kit for dense methods (issue 30): real vLLM linear layers and lm_heads, checked against float64.

A method that declares dense layer kinds (``Method.layers`` without ``experts``) gets this suite
instead of the MoE one. For each kind it declares, the layer vLLM builds for it is made for real
(``ReplicatedLinear`` with bias for ``attention`` / ``dense``, ``ParallelLMHead`` for ``lm_head``,
in a one-rank vLLM parallel state), the method is built the way the dense seam builds it
(``cls(vllms_method, **options)``), the layer's bf16 weight (and bias) loaded with seeded values,
``process_weights_after_loading`` run, and forwards at the shape's token counts compared with
``x @ W.T (+ b)`` in float64 (``max|out-ref|/max|ref|`` within the tolerance), plus a 3-D input
(``[batch, seq, K]``) and the output dtype; then ``heavy-tailed``: on inputs with massive-activation
channels the rms error is at most 1.10x a Q8_0 emulation's (:mod:`.heavy_tail`); then ``compiled``:
the first kind's ``apply`` under ``torch.compile(fullgraph=True)`` with a dynamic token count equals
eager (vLLM's default mode, :mod:`.compiled`). Shapes: ``small`` (K=64, N=96; lm_head 512 x 64) and
``20b`` (GPT-OSS-20B's qkv 2880->5120, o_proj 4096->2880, lm_head 2880->201088).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

from ..error_measure import DEFAULT_TOLERANCE
from ..keys import Key
from ..methods import BuildContext, Method, construct
from ..vllm.platform import quantize_method_base
from .report import CheckResult, Report, Status
from .shapes import MoeShape

#: (kind, K, N) per shape; attention runs both GPT-OSS projections at 20b
SMALL = {"attention": [(64, 96)], "dense": [(64, 96)], "lm_head": [(64, 512)]}
REAL_20B = {"attention": [(2880, 5120), (4096, 2880)], "dense": [(2880, 2880)], "lm_head": [(2880, 201088)]}


def dense_sizes(shape: MoeShape) -> dict[str, list[tuple[int, int]]]:
    if shape.small:
        return SMALL
    if (shape.hidden, shape.intermediate) == (2880, 2880):
        return REAL_20B
    return {k: [(shape.hidden, shape.intermediate)] for k in SMALL}


@contextlib.contextmanager
def vllm_one_rank() -> Iterator[None]:
    """vLLM's config and a one-rank parallel state, which vLLM's linear layers read when built."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    with set_current_vllm_config(VllmConfig()):
        if not model_parallel_is_initialized():
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(1, 1)
        yield


def _layer(kind: str, k: int, n: int) -> Any:
    import torch
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    if kind == "lm_head":
        return ParallelLMHead(n, k, prefix="lm_head", disable_tp=True, params_dtype=torch.bfloat16)
    prefix = "model.layers.0.attn.qkv_proj" if kind == "attention" else "model.layers.0.mlp.dense"
    return ReplicatedLinear(k, n, bias=True, params_dtype=torch.bfloat16, prefix=prefix, disable_tp=True)


def _built(method: Method, kind: str, k: int, n: int, options: dict[str, Any], gen: Any) -> tuple[Any, Any, Any, Any]:
    """A layer of ``kind`` with random weights, the method built on it as the dense seam builds it and
    prepared: ``(layer, method, weight, bias)``."""
    import torch

    layer = _layer(kind, k, n)
    weight = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
    bias = None
    layer.weight.data.copy_(weight)
    if getattr(layer, "bias", None) is not None:
        bias = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16)
        layer.bias.data.copy_(bias)
    context = BuildContext(Key("unquantized", "kit", "cpu", kind), method.name, "quantreg check-method", options,
                           str(layer.prefix), layer)
    built = construct(method.load(base=quantize_method_base()), layer.quant_method, context)
    layer.quant_method = built
    built.process_weights_after_loading(layer)
    return layer, built, weight, bias


def _check_kind(method: Method, kind: str, k: int, n: int, tokens: tuple[int, ...], tolerance: float,
                options: dict[str, Any]) -> str:
    """One layer of ``kind``: build, load, prepare, forwards; the worst error, or raises AssertionError."""
    import torch

    gen = torch.Generator().manual_seed(k * 7 + n)
    layer, built, weight, bias = _built(method, kind, k, n, options, gen)
    worst = 0.0
    for m in tokens:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        with torch.inference_mode():
            out = built.apply(layer, x, bias)
        assert out.shape == (m, n) and out.dtype == x.dtype, f"{kind}: output {tuple(out.shape)} {out.dtype}"
        ref = torch.empty(m, n, dtype=torch.float64)
        for s in range(0, n, 16384):
            ref[:, s:s + 16384] = x.double() @ weight[s:s + 16384].double().t()
        if bias is not None:
            ref += bias.double()
        err = float((out.double() - ref).abs().max() / ref.abs().max())
        assert err <= tolerance, f"{kind} {k}->{n}, {m} tokens: error {err:.3g} > tolerance {tolerance:g}"
        worst = max(worst, err)
    x3 = torch.randn(2, 3, k, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        out3 = built.apply(layer, x3, bias)
    assert out3.shape == (2, 3, n), f"{kind}: a [2, 3, K] input gave {tuple(out3.shape)}"
    return f"{k}->{n}: max error {worst:.3g} over {', '.join(map(str, tokens))} tokens"


def _compiled_kind(method: Method, kind: str, k: int, n: int, tolerance: float) -> str:
    """``apply(layer, x, bias)`` under ``torch.compile(fullgraph=True)``, the token count dynamic, equals
    eager at 1 and 7 tokens (vLLM's default mode traces linear layers' methods too; :mod:`.compiled`)."""
    import torch

    from .compiled import HINT, first_line, where_trace_stopped

    gen = torch.Generator().manual_seed(k * 11 + n)
    layer, built, _weight, bias = _built(method, kind, k, n, {}, gen)
    torch._dynamo.reset()

    def call(x: Any) -> Any:
        return built.apply(layer, x, bias)

    fn = torch.compile(call, fullgraph=True, dynamic=True, backend="aot_eager")
    for m in (1, 7):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        with torch.no_grad():
            eager = call(x)
            try:
                out = fn(x)
            except Exception as exc:
                where = where_trace_stopped(exc)
                raise AssertionError(f"{kind}: torch.compile(fullgraph=True) of apply failed at {m} token(s): "
                                     f"{first_line(exc)}" + (f" at {where}" if where else "") + f"; {HINT}") from None
        assert out.shape == eager.shape and out.dtype == eager.dtype, \
            f"{kind}: compiled output {tuple(out.shape)} {out.dtype}, eager {tuple(eager.shape)} {eager.dtype}"
        err = float((out.double() - eager.double()).abs().max() / (eager.double().abs().max() or 1.0))
        assert err <= tolerance, f"{kind}: compiled differs from eager at {m} token(s): {err:.3g}"
    return f"{kind} {k}->{n}: apply under torch.compile(fullgraph=True, dynamic) equals eager at 1 and 7 tokens"


def _heavy_tailed(method: Method, kind: str) -> tuple[bool, str]:
    """One ``kind`` layer at :data:`.heavy_tail.DENSE_SIZE` against float64 and a Q8_0 emulation on
    heavy-tailed inputs (:mod:`.heavy_tail`): ``(passed, detail)``, the detail naming every failing case."""
    import torch

    from . import heavy_tail

    k, n = heavy_tail.DENSE_SIZE
    layer, built, weight, bias = _built(method, kind, k, n, {}, torch.Generator().manual_seed(54))
    rows = heavy_tail.dense_rows(lambda x: built.apply(layer, x, bias), weight, bias, seed=54)
    return heavy_tail.verdict(method.name, f"{kind} {k}->{n}", rows)


def run_dense_suite(method: Method, report: Report, device: str, tolerance: float | None,
                    shape: MoeShape) -> None:
    """Fill ``report`` with the dense checks of ``method`` (see the module docstring)."""
    bound = DEFAULT_TOLERANCE if tolerance is None else tolerance
    report.tolerance = bound
    report.results.append(CheckResult("registered", "registered for dense layer kinds", Status.PASS,
                                      f"layers: {', '.join(method.layers)}"))
    available = method.availability(device)
    report.available, report.availability = available.ok, available.reason
    if not available.ok:
        report.results.append(CheckResult("available", "can run here", Status.SKIPPED, available.reason, True))
        return
    report.results.append(CheckResult("available", "can run here", Status.PASS, available.reason, True))
    tokens = (1, 7, 64) if shape.small else (1, 16)
    sizes = dense_sizes(shape)
    with vllm_one_rank():
        for kind in method.layers:
            for k, n in sizes[kind]:
                check = f"forward_{kind}"
                title = f"{kind} layer against float64 (bias, 3-D input, dtype)"
                try:
                    detail = _check_kind(method, kind, k, n, tokens, bound, {})
                except Exception as exc:
                    report.results.append(CheckResult(check, title, Status.FAIL,
                                                      f"{k}->{n}: {type(exc).__name__}: {exc}", True))
                else:
                    report.results.append(CheckResult(check, title, Status.PASS, detail, True))
        kind = method.layers[0]
        title = "as fine as llama.cpp's Q8_0 on heavy-tailed activations"
        try:
            passed, detail = _heavy_tailed(method, kind)
        except Exception as exc:
            passed, detail = False, f"{type(exc).__name__}: {exc}"
        report.results.append(CheckResult("heavy-tailed", title, Status.PASS if passed else Status.FAIL, detail, True))
        k, n = sizes[kind][0]
        title = "runs inside torch.compile(fullgraph=True) as in eager"
        try:
            detail = _compiled_kind(method, kind, k, n, bound)
        except Exception as exc:
            report.results.append(CheckResult("compiled", title, Status.FAIL, f"{type(exc).__name__}: {exc}", True))
        else:
            report.results.append(CheckResult("compiled", title, Status.PASS, detail, True))
