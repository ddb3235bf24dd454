"""``verify:`` for dense layers (issue 30): the chosen method against the checkpoint's weights in float64.

A dense method replaces the layer's weights at load (an int8 method keeps only its int8 copy), so
the reference is taken before that: for a verified layer, :class:`VerifyingDense` copies the loaded
weight (and bias) before the chosen method's ``process_weights_after_loading`` (one copy of the
layer's weight, logged), runs a load check on seeded tokens, and on sampled forward calls (the
spec's ``first`` / ``every``) compares the chosen output with ``x @ W.T (+ b)`` in float64, the
error ``max |out - ref| / max |ref|`` reported per call like the MoE ``verify:`` (log line and a
``verify`` record in the trail, :class:`quantreg.vllm.verify._Report`). The chosen output is
returned unchanged; a failing reference turns verification off with one WARNING. To vLLM the
wrapper is the chosen method (its attributes, ``__class__`` included: the one proxy base, :mod:`.proxy`).

Dense layers verify ``against: float64`` only: ``vllm``'s own method is refused by the table
schema (it is what the rule replaces), and a second dense method would need its own copy of the
weights. ``layers`` counts decoder layers by their index; the lm_head (no index) is always covered.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearMethodBase

from ..decision import Decision
from ..error_measure import relative_error
from ..mode import Mode
from ..problems import quantreg_logger
from ..table.verify import FLOAT64, layer_index
from .proxy import Proxy
from .verify import _Report

logger = quantreg_logger("vllm.quantreg.verify")
LOAD_TOKENS = 4


class VerifyingDense(Proxy, LinearMethodBase, forwards=LinearMethodBase):  # type: ignore[misc]
    """The chosen dense method to vLLM (:class:`.proxy.Proxy`), plus the float64 comparison on sampled calls."""

    _quantreg_own = frozenset({"_inner", "_spec", "_report", "_shadow", "_bias", "_calls", "_next", "_active"})

    def __init__(self, inner: Any, decision: Decision, report: _Report) -> None:
        assert decision.verify is not None
        self._inner, self._spec, self._report = inner, decision.verify, report
        self._shadow: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._calls = 0
        self._next = self._spec.next_call(0)
        self._active = True

    def _quantreg_target(self) -> Any:
        return self._inner

    @property
    def quantreg_verified(self) -> Any:
        """The method this one watches (the dense seam's coverage walk counts it as the decided one)."""
        return self._inner

    def create_weights(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
        return self._inner.create_weights(layer, *args, **kwargs)

    def process_weights_after_loading(self, layer: Any) -> None:
        weight = getattr(layer, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.is_floating_point():
            self._shadow = weight.detach().clone()
            bias = getattr(layer, "bias", None)
            self._bias = bias.detach().clone() if isinstance(bias, torch.Tensor) else None
            logger.info("%s: keeping a copy of the loaded weight %s (%.1f MB) as the float64 reference",
                        self._report.head(), tuple(weight.shape), weight.numel() * weight.element_size() / 1e6)
        self._inner.process_weights_after_loading(layer)
        if self._shadow is None:
            self._active = False
            self._report.cannot("the layer has no floating-point 2-D weight to take a float64 reference from")
            return
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(LOAD_TOKENS, self._shadow.shape[1], generator=gen).to(self._shadow.dtype)
        try:
            out = self._inner.apply(layer, x, self._bias)
            self._report.load_result(relative_error(out.double(), self._reference(x)), LOAD_TOKENS)
        except Exception as exc:
            self._active = False
            self._report.cannot(f"the load check failed: {type(exc).__name__}: {exc}")

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        assert self._shadow is not None
        ref = x.reshape(-1, x.shape[-1]).double() @ self._shadow.double().t()
        if self._bias is not None:
            ref = ref + self._bias.double()
        return ref

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = self._inner.apply(layer, x, bias)
        self._calls += 1
        if self._active and self._calls == self._next:
            self._next = self._spec.next_call(self._calls)
            try:
                ref = self._reference(x)
                self._report.result(self._calls, relative_error(out.reshape(ref.shape).double(), ref))
            except Exception as exc:  # the verifying side never changes the chosen output
                self._active = False
                self._report.cannot(f"the float64 reference failed: {type(exc).__name__}: {exc}", when="live")
        return out


def maybe_verify_dense(method: Any, vllms: Any, decision: Decision, prefix: str, layer: Any, mode: Mode) -> Any:
    """``method``, or a :class:`VerifyingDense` around it when the rule's ``verify:`` covers this layer."""
    spec = decision.verify
    if spec is None:
        return method
    index = layer_index(prefix)
    if index is not None and not spec.covers(index, range(index + 1)):
        return method
    report = _Report(prefix, decision.key, decision.method, spec.against, spec, mode.strict)
    if spec.against != FLOAT64:
        report.cannot(f"dense layers verify against {FLOAT64} only, not '{spec.against}'", when="route")
        return method
    return VerifyingDense(method, decision, report)
