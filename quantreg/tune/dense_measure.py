"""Build, check against float64 and time every dense method for one layer kind on real vLLM layers.

Why vLLM's own GPT-OSS layers (:mod:`quantreg.testing.gpt_oss_dense`): the ``QKVParallelLinear``,
``RowParallelLinear``, ``GateLinear`` and ``ParallelLMHead`` vLLM builds for the model, at the
checkpoint's sizes, loaded through their ``weight_loader`` and finalised by
``process_weights_after_loading``; vLLM's own method (``vllm``: bf16, oneDNN on CPU) is built the
same way as every plugin method. The kind ``attention`` is timed as one decoder layer's
``qkv_proj`` then ``o_proj``; ``dense`` is the router; ``lm_head`` the lm_head.

Correctness first, at every size timed: each built method runs :data:`CHECK_TOKENS` and is
compared with ``x @ W.T (+ b)`` in float64 (``W``, ``b``: the checkpoint's, checked equal to what
vLLM's loader wrote into every built layer), ``max |out - ref| / max |ref|`` over the whole output, computed in
column blocks so a 201,088-wide lm_head never holds a whole float64 copy of its weight. A method
past the tolerance is refused, as is one that fails to build, raises or returns anything but a
finite ``[tokens, N]`` tensor. Whether a method is *lossy* (beyond bf16's own error) is judged by
:mod:`.dense`, not here: every error is kept.

Timing as for the experts (:mod:`.measure`): the same inputs per token count, rounds interleaved
with the method order rotated, one warm-up round discarded, medians kept with every round's
samples, every timed output checked: the one loop of :mod:`.rounds`.

Imports torch and vLLM (through the kit).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..keys import Key
from ..methods import VLLM_METHOD, BuildContext, keeps_vllm
from ..models.checkpoint import read_tensors
from ..problems import printable
from ..registry import Registry
from ..testing import gpt_oss_dense as gd
from ..testing.dense import vllm_one_rank
from ..vllm.platform import quantize_method_base
from .rank import TOKENS, Result
from .rounds import Progress
from .side_by_side import SideBySide

CHECK_TOKENS = tuple(sorted({1, 5, *TOKENS}))
"""Token counts checked against float64: every count timed, and 5 (an odd decode batch)."""
SEED = 4321
BLOCK = 16384
"""Output columns per float64 block of the check (an lm_head block: 16384 x 2880 float64, 0.38 GB)."""
Tensors = Mapping[str, Mapping[str, torch.Tensor]]
"""Per part (``qkv_proj``, ...): the checkpoint's tensors under the loader's names (``weight``, ``q_proj.bias``...)."""


def synthetic_tensors(kind: str, shape: gd.DenseShape, seed: int = SEED) -> dict[str, dict[str, torch.Tensor]]:
    """Seeded bf16 weights of ``kind``'s parts at ``shape`` (``--synthetic``), scaled like a trained layer's
    (``1/sqrt(K)``, biases ~0.02): only the relative error is judged, so the scale only has to be sane."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for part in gd.PARTS[kind]:
        k, n = shape.in_out(part)
        if part == "qkv_proj":
            q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
            out[part] = {}
            for shard, rows in (("q", q), ("k", kv), ("v", kv)):
                out[part][f"{shard}_proj.weight"] = (torch.randn(rows, k, generator=gen) / k ** 0.5).to(torch.bfloat16)
                out[part][f"{shard}_proj.bias"] = (torch.randn(rows, generator=gen) * 0.02).to(torch.bfloat16)
            continue
        out[part] = {"weight": (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16)}
        if part != "lm_head":
            out[part]["bias"] = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
    return out


def output_problem(out: Any, tokens: int, n: int) -> str | None:
    """Why ``out`` is not a dense layer's output for ``tokens`` rows (``None``: it is)."""
    if not isinstance(out, torch.Tensor):
        return f"returned {printable(type(out).__name__)}, expected a tensor of shape [{tokens}, {n}]"
    if tuple(out.shape) != (tokens, n):
        return f"returned shape {list(out.shape)}, expected [{tokens}, {n}]"
    if not out.is_floating_point():
        return f"returned dtype {out.dtype}, expected a floating-point tensor"
    if not bool(torch.isfinite(out).all()):
        bad = int((~torch.isfinite(out)).sum())
        return f"returned {bad} non-finite value{'s' if bad != 1 else ''} (NaN or inf) of {out.numel()}"
    return None


def reference_blocks(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> list[torch.Tensor]:
    """``x @ weight.T + bias`` in float64, in column blocks of :data:`BLOCK`."""
    xd = x.double()
    blocks = []
    for s in range(0, weight.shape[0], BLOCK):
        ref = xd @ weight[s:s + BLOCK].double().t()
        if bias is not None:
            ref += bias[s:s + BLOCK].double()
        blocks.append(ref)
    return blocks


def blocked_error(out: torch.Tensor, blocks: Sequence[torch.Tensor]) -> float:
    """``max |out - ref| / max |ref|`` over every block (the one measure of quantreg.error_measure)."""
    diff, scale, s = 0.0, 0.0, 0
    for ref in blocks:
        width = ref.shape[1]
        diff = max(diff, float((out[:, s:s + width].double() - ref).abs().max()))
        scale = max(scale, float(ref.abs().max()))
        s += width
    return diff / (scale if scale > 0 else 1.0)


def source_weights(part: str, tensors: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [N, K], bias or None) of ``part`` as one rank holds them: q, k, v stacked for the QKV layer.

    The float64 reference multiplies these; every built layer is checked equal to them after vLLM's
    loader ran (before any method converts its copy), so no second copy of a 1.2 GB lm_head is kept.
    """
    if part == "qkv_proj":
        return (torch.cat([tensors[f"{s}_proj.weight"] for s in "qkv"]),
                torch.cat([tensors[f"{s}_proj.bias"] for s in "qkv"]))
    return tensors["weight"], tensors.get("bias")


def tensors_problem(kind: str, shape: gd.DenseShape, tensors: Mapping[str, Mapping[str, torch.Tensor]]) -> str | None:
    """Why the checkpoint's ``kind`` tensors cannot be measured at ``shape`` (``None``: they can), said with
    the part, the tensor, its shape and what was expected.

    Checked before any layer is built: a wrong-shaped tensor ended in vLLM's loader as ``KeyError:
    'lm_head'``, and non-finite weights were blamed on vLLM's loader (``NaN != NaN`` failed the equality
    check that the loader wrote the checkpoint's weights).
    """
    for part in gd.PARTS[kind]:
        k, n = shape.in_out(part)
        have = tensors.get(part) or {}
        for name, tensor in have.items():
            if not tensor.is_floating_point():
                return f"{part}: {name} is {str(tensor.dtype).removeprefix('torch.')}; expected floating-point weights"
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                return (f"{part}: {name} holds {bad} non-finite value(s) (NaN or inf); the float64 reference "
                        "needs finite weights")
        try:
            weight, bias = source_weights(part, have)
        except KeyError as exc:
            return f"{part}: tensor {printable(str(exc.args[0]))} missing"
        except RuntimeError:  # q, k, v whose widths do not stack
            shapes = ", ".join(f"{name} {list(t.shape)}" for name, t in have.items())
            return f"{part}: {shapes}; expected q/k/v weights of width {k} (hidden) to stack"
        if tuple(weight.shape) != (n, k):
            return f"{part}: weight has shape {list(weight.shape)}; expected [{n}, {k}] at these sizes"
        if bias is not None and tuple(bias.shape) != (n,):
            return f"{part}: bias has shape {list(bias.shape)}; expected [{n}]"
    return None


class DenseMeasurement(SideBySide):
    """The dense methods of one key (its layer kind), built once, then checked and timed side by side."""

    def __init__(self, registry: Registry, key: Key, shape: gd.DenseShape, tensors: Tensors, *,
                 tolerance: float, progress: Progress) -> None:
        super().__init__(registry, key, progress)
        self.shape, self.tensors = shape, tensors
        self.parts = gd.PARTS[key.layer]
        self.tolerance = tolerance
        self.layers: dict[str, dict[str, Any]] = {}
        self.refs: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def candidates(self) -> list[str]:
        """vLLM's own method and every registered method that declares this layer kind, by name."""
        return sorted({VLLM_METHOD, *(n for n, m in self.registry.methods.items() if self.key.layer in m.layers)})

    def build(self, name: str) -> dict[str, Any]:
        """``name``'s layers, one per part of the kind, each loaded from the checkpoint's tensors."""
        built: dict[str, Any] = {}
        for part in self.parts:
            layer = gd.build(part, self.shape)
            gd.load(layer, part, self.tensors[part])
            if part not in self.refs:
                self.refs[part] = source_weights(part, self.tensors[part])
            weight, bias = self.refs[part]
            if not torch.equal(layer.weight, weight) or (bias is not None and not torch.equal(layer.bias, bias)):
                raise RuntimeError(f"vLLM's loader wrote {part}'s weights differently from the checkpoint's "
                                   "(the float64 reference would not be this layer's)")
            if not keeps_vllm(name):
                context = BuildContext(self.key, name, "quantreg tune", {}, str(layer.prefix), layer)
                layer.quant_method = self.registry.methods[name].build(layer.quant_method, context,
                                                                       base=quantize_method_base())
            layer.quant_method.process_weights_after_loading(layer)
            built[part] = layer
        return built

    def inputs(self, tokens: int, seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed + tokens)
        return {part: torch.randn(tokens, self.shape.in_out(part)[0], generator=gen).to(torch.bfloat16)
                for part in self.parts}

    def check_all(self) -> None:
        """Every built method against float64 at :data:`CHECK_TOKENS`; the worst error kept, refusals said."""
        worst: dict[str, float] = dict.fromkeys(self.layers, 0.0)
        for tokens in CHECK_TOKENS:
            xs = self.inputs(tokens, SEED)
            for part in self.parts:
                weight, bias = self.refs[part]
                blocks = reference_blocks(xs[part], weight, bias)
                for name in sorted(self.layers):
                    result = self.results[name]
                    if result.error is not None:
                        continue
                    self.progress(f"{self.key}: check {name} {part} at {tokens} token{'s' if tokens != 1 else ''} "
                                  "against float64", 0.5, detail=True)
                    out, error = self.run(name, tokens, functools.partial(self._forward, name, part, xs[part]))
                    error = error or output_problem(out, tokens, weight.shape[0])
                    if error is not None:
                        result.error = f"forward of {part} at {tokens} token{'s' if tokens != 1 else ''}: {error}"
                        continue
                    err = blocked_error(out, blocks)
                    worst[name] = max(worst[name], err)
                    if not err <= self.tolerance:
                        result.error = (f"numerics: relative error {err:.3g} > tolerance {self.tolerance:g} "
                                        f"in {part} at {tokens} token{'s' if tokens != 1 else ''} (float64 reference)")
                del blocks
        for name in list(self.layers):
            result = self.results[name]
            result.rel_error = worst[name]
            result.ok = result.error is None
        self.refs.clear()
        self.drop_refused()

    def _forward(self, name: str, part: str, x: torch.Tensor) -> Any:
        with torch.inference_mode(), contextlib.redirect_stdout(sys.stderr):
            return gd.forward(self.layers[name][part], part, x)

    def time_all(self, deadline: float, tokens: Sequence[int] = TOKENS) -> int:
        """Interleaved timing rounds until ``deadline`` (``time.monotonic()``); returns the rounds measured."""
        names = sorted(self.layers)
        if not names:
            return 0
        inputs = {t: self.inputs(t, SEED + 97) for t in tokens}

        def forward(name: str, t: int) -> list[Any]:
            with torch.inference_mode():
                return [gd.forward(self.layers[name][part], part, inputs[t][part]) for part in self.parts]

        def problem(outs: list[Any], t: int) -> str | None:
            for part, out in zip(self.parts, outs):
                error = output_problem(out, t, self.shape.in_out(part)[1])
                if error is not None:
                    return error
            return None

        return self.time_rounds(names, tokens, deadline, forward, problem)

    def close(self) -> None:
        self.refs.clear()
        super().close()


def measure_dense(registry: Registry, key: Key, shape: gd.DenseShape, tensors: Tensors, *, tolerance: float,
                  deadline: float, progress: Progress) -> tuple[list[Result], int]:
    """All dense methods for ``key``: built, checked, timed until ``deadline``. Returns results and rounds."""
    m = DenseMeasurement(registry, key, shape, tensors, tolerance=tolerance, progress=progress)
    try:
        with vllm_one_rank():
            m.build_all(m.build)
            m.check_all()
            rounds = m.time_all(deadline)
    finally:
        m.close()
    return [m.results[n] for n in sorted(m.results)], rounds


def checkpoint_names(kind: str, layer: int, tied: bool) -> dict[str, dict[str, str]]:
    """Per part: loader name -> the checkpoint's tensor name (GPT-OSS's, as vLLM's loader maps them)."""
    p = f"model.layers.{layer}."
    if kind == "attention":
        qkv = {f"{s}_proj.{w}": f"{p}self_attn.{s}_proj.{w}" for s in "qkv" for w in ("weight", "bias")}
        return {"qkv_proj": qkv, "o_proj": {w: f"{p}self_attn.o_proj.{w}" for w in ("weight", "bias")}}
    if kind == "dense":
        return {"router": {w: f"{p}mlp.router.{w}" for w in ("weight", "bias")}}
    return {"lm_head": {"weight": "model.embed_tokens.weight" if tied else "lm_head.weight"}}


def checkpoint_tensors(model_dir: str, names: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's tensors ``names`` names, read from their shards (index followed, inside the checkpoint).

    Raises ``LookupError`` with the file and tensor named when one is missing or not floating point.
    """
    read = read_tensors(model_dir, [name for wanted in names.values() for name in wanted.values()])
    out: dict[str, dict[str, torch.Tensor]] = {}
    for part, wanted in names.items():
        out[part] = {}
        for ours, name in wanted.items():
            tensor = read[name]
            if not tensor.is_floating_point():
                raise LookupError(f"{printable(model_dir)}: {name} is {str(tensor.dtype).removeprefix('torch.')}; "
                                  "expected a floating-point (bf16) dense weight")
            out[part][ours] = tensor.to(torch.bfloat16).contiguous()
    return out
