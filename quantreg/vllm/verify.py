"""``verify:`` inside vLLM: run a second method beside the chosen one and report how far apart they are.

The seam builds the chosen method as usual and hands it to :func:`maybe_verify`. For a layer the
rule's ``verify:`` covers (decoder-layer index from the prefix ``model.layers.N.mlp.experts``),
the result is a :class:`VerifyingMethod`: a ``FusedMoEMethodBase`` that *is* the chosen method to
vLLM (every attribute, property and method is the chosen one's, ``__class__`` included: the one
proxy base, :mod:`.proxy`) except at these points:

* ``create_weights`` also runs the ``against`` method's ``create_weights`` on a scratch copy of
  the layer on the meta device (nothing allocated), to learn which parameters it reads and check
  that their shapes and dtypes are those the chosen method created;
* ``process_weights_after_loading`` first copies those loaded parameters into a *shadow* of the
  layer (a shallow copy with its own parameters) and only then lets the chosen method change the
  originals (repacking, prepacking, dequantising); the ``against`` method then processes the
  shadow. The cost is one copy of the packed weights per verified layer, logged at start-up;
* at the end of ``process_weights_after_loading`` (both methods hold their processed weights,
  vLLM has not yet reported the engine ready) a *load check* runs both methods on a synthetic
  batch (:data:`LOAD_TOKENS` seeded tokens, router logits of the layer's width) through the real
  weights: an exceedance there refuses the start in strict mode (one ``quantreg (strict): verify:``
  line, :func:`quantreg.vllm.startup.fail_strict`) and is a WARNING before serving in lenient mode;
* on a verified forward call (the first ``first`` calls, then one in ``every``) the ``against``
  method runs on the same input with the same routing (the chosen method's ``topk_ids`` /
  ``topk_weights`` when vLLM routed, the same router logits when the methods route inside), the
  error ``max |out - ref| / max |ref|`` is reported, and the chosen output is returned unchanged.
  Any other call costs one counter increment and one comparison.

``against: float64`` is the format's float64 definition (:mod:`quantreg.models.gpt_oss_moe`) on
the shadow's packed weights, decoding only the experts a call routes to (:mod:`.verify_reference`).
An ``against`` method is built like the chosen one (:func:`.route.build`, behind the one caller of
plugin code).

**The verifying side is contained** (:meth:`VerifyingMethod._against_output`): whatever the
``against`` method does -- raise (``SystemExit`` included), return ``None``, a wrongly shaped or
non-finite tensor -- the chosen method's output is returned untouched and verification of that
layer is turned off with one WARNING. Strict mode fails closed *at load* (the load check); on a
live request nothing is raised in either mode (an ERROR line in strict), because a raise there would
end the engine mid-request with a traceback. Only ``KeyboardInterrupt`` passes through.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

from ..decision import Decision
from ..error_measure import relative_error
from ..keys import Key
from ..methods import BuildContext
from ..mode import Mode
from ..problems import printable, quantreg_logger, strict_error
from ..registry import Registry
from ..table.verify import FLOAT64, VerifySpec, layer_index
from .platform import fused_moe_method_base
from .proxy import Proxy
from .route import build, failure_text
from .shadow import fault_of, layer_copy, probe_weights
from .verify_reference import Float64Reference, synthetic_batch, vllm_default_routing

logger = quantreg_logger("vllm.quantreg.verify")


def _audit_line(record: Mapping[str, Any]) -> None:
    """One ``verify`` line in the ``QUANTREG_DECISIONS`` trail (:func:`quantreg.audit.append_record`)."""
    from ..audit import append_record

    append_record(record)


class _Report:
    """Who is compared with whom, and how a result is reported (log, audit line, strict error)."""

    def __init__(self, prefix: str, key: Key, method: str, against: str, spec: VerifySpec, strict: bool) -> None:
        self.prefix, self.key, self.method, self.against = prefix, key, method, against
        self.spec, self.strict = spec, strict

    def head(self) -> str:
        return f"quantreg verify: {self.prefix} {self.key}: {self.method} vs {self.against}"

    def result(self, call: int, error: float) -> None:
        """One live comparison: INFO within tolerance, WARNING (ERROR in strict) beyond it; never raises."""
        ok = error <= self.spec.tolerance
        self._record(call, error, ok, "live")
        text = (f"{self.head()}: call {call}: max|out-ref|/max|ref| = {error:.4g} "
                f"{'within' if ok else 'EXCEEDS'} tolerance {self.spec.tolerance:g}")
        if ok:
            logger.log(logging.INFO if call <= self.spec.first else logging.DEBUG, "%s", text)
        else:  # strict refused such a kernel at load; a raise here would end the engine mid-request
            logger.log(logging.ERROR if self.strict else logging.WARNING, "%s", text)

    def load_result(self, error: float, tokens: int) -> None:
        """The load check: INFO within tolerance; beyond it a WARNING before serving, or (strict) the end."""
        ok = error <= self.spec.tolerance
        self._record(0, error, ok, "load")
        text = (f"{self.head()}: load: max|out-ref|/max|ref| = {error:.4g} {'within' if ok else 'EXCEEDS'} "
                f"tolerance {self.spec.tolerance:g} ({tokens} synthetic tokens through the loaded weights)")
        if ok:
            logger.info("%s", text)
            return
        if self.strict:
            from .startup import fail_strict

            fail_strict(strict_error(
                f"verify: {self.prefix} {self.key}: {self.method} vs {self.against}: error {error:.4g} on {tokens} "
                f"synthetic tokens at load exceeds tolerance {self.spec.tolerance:g}; refusing to start"))
        logger.warning("%s", text)

    def _record(self, call: int, error: float, ok: bool, phase: str) -> None:
        from ..audit import utc_time

        _audit_line({"event": "verify", "time": utc_time(), "pid": os.getpid(), "prefix": self.prefix,
                     "key": self.key.as_json(), "method": self.method, "against": self.against,
                     "phase": phase, "call": call, "error": error, "tolerance": self.spec.tolerance, "ok": ok})

    def cannot(self, why: str, *, when: str = "load") -> None:
        """Verification of this layer is off (the chosen method still runs).

        Strict mode refuses that while the layer is built (``when="route"``: a ``QuantregError``
        the seam's boundary passes on) or loaded (one line, :func:`fail_strict`); on a live request
        (``when="live"``) it is an ERROR line, never a raise.
        """
        text = f"{self.head()}: cannot verify ({why}); {self.method} runs unverified"
        if self.strict and when != "live":
            error = strict_error(f"verify: {text.removeprefix('quantreg verify: ')}")
            if when == "route":
                raise error
            from .startup import fail_strict

            fail_strict(error)
        logger.log(logging.ERROR if self.strict else logging.WARNING, "%s", printable(text))


class _State:
    """The mutable part of a verifying method, kept out of the delegated attribute space."""

    __slots__ = ("active", "calls", "extras", "next", "reads", "shadow")

    def __init__(self, spec: VerifySpec) -> None:
        self.calls = 0
        self.next = spec.next_call(0)
        self.active = True
        self.reads: tuple[str, ...] = ()  # parameter names the against method reads
        self.extras: dict[str, Any] = {}  # attributes its create_weights set on the layer
        self.shadow: Any = None


class VerifyingMethod(Proxy, FusedMoEMethodBase, forwards=FusedMoEMethodBase):  # type: ignore[misc]
    """The chosen method to vLLM (:class:`.proxy.Proxy`), plus sampled comparisons with ``against``."""

    _quantreg_own = frozenset({"_quantreg_inner", "_quantreg_against", "_quantreg_report", "_quantreg_spec",
                               "_quantreg_state"})

    def __init__(self, inner: Any, against: Any, spec: VerifySpec, report: _Report) -> None:
        # FusedMoEMethodBase.__init__ is not called: every attribute it would set is the inner one's.
        self._quantreg_inner = inner
        self._quantreg_against = against
        self._quantreg_spec = spec
        self._quantreg_report = report
        self._quantreg_state = _State(spec)

    def _quantreg_target(self) -> Any:
        return self._quantreg_inner

    @property
    def quantreg_verifying(self) -> tuple[Any, Any]:
        """(chosen method, against method or float64 reference): for tests and diagnostics."""
        return self._quantreg_inner, self._quantreg_against

    # -- the lifecycle ----------------------------------------------------------------------
    def create_weights(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
        result = self._quantreg_inner.create_weights(layer, *args, **kwargs)
        state, against = self._quantreg_state, self._quantreg_against

        def probe() -> None:
            if isinstance(against, Float64Reference):
                state.reads = tuple(n for n in against.PARAMETERS if n in layer._parameters)
                against.check_layer(layer)
            else:
                state.reads, state.extras = probe_weights(against, layer, *args, **kwargs)

        fault = fault_of(probe)
        if fault is not None:
            state.active = False
            self._quantreg_report.cannot(f"{type(fault).__name__}: {fault}")
        return result

    def process_weights_after_loading(self, layer: Any) -> None:
        state = self._quantreg_state
        shadow = None
        if state.active:  # copy BEFORE the chosen method may repack or dequantise the loaded weights
            shadow = layer_copy(layer)
            copied = 0
            for name in state.reads:
                tensor = layer._parameters[name].data.clone()
                copied += tensor.numel() * tensor.element_size()
                shadow._parameters[name] = torch.nn.Parameter(tensor, requires_grad=False)
            shadow.__dict__.update(state.extras)
            shadow.__dict__["quant_method"] = self._quantreg_against
        self._quantreg_inner.process_weights_after_loading(layer)
        if shadow is None:
            return
        against = self._quantreg_against
        fault = None if isinstance(against, Float64Reference) else fault_of(
            lambda: against.process_weights_after_loading(shadow))
        if fault is not None:
            state.active = False
            self._quantreg_report.cannot(f"{type(fault).__name__} in its process_weights_after_loading: {fault}")
            return
        state.shadow = shadow
        spec = self._quantreg_spec
        logger.info("%s: verifying at load, the first %d forward calls, then 1 in %d, tolerance %g; shadow copy "
                    "of the loaded weights (%s): %.2f MiB", self._quantreg_report.head(), spec.first, spec.every,
                    spec.tolerance, ", ".join(state.reads), copied / 2**20)
        self._load_check(layer)

    def _load_check(self, layer: Any) -> None:
        """Both methods on a seeded synthetic batch through the loaded weights, before any traffic.

        The chosen method runs on the real layer exactly as a forward would call it (its own
        routing if it routes inside, vLLM's plain top-k otherwise); the comparison is the live one.
        If the chosen method cannot run outside vLLM's runner here, the load check is skipped with
        one WARNING (strict: refused, because nothing would then be checked before traffic).
        """
        report, state = self._quantreg_report, self._quantreg_state
        why: str | None = None
        try:
            x, logits = synthetic_batch(layer)
            inner = self._quantreg_inner
            with torch.no_grad():
                topk = None if inner.is_monolithic else vllm_default_routing(layer, logits)
                if topk is None:
                    out = inner.apply_monolithic(layer=layer, x=x.clone(), router_logits=logits.clone(),
                                                 input_ids=None)
                else:
                    out = inner.apply(layer=layer, x=x.clone(), topk_weights=topk[0].clone(),
                                      topk_ids=topk[1].clone(), shared_experts=None, shared_experts_input=None)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            why = f"{type(exc).__name__}: {exc}"
        if why is not None:
            logger.log(logging.ERROR if report.strict else logging.WARNING,
                       "%s: the load check could not run %s outside vLLM's runner (%s); live sampling still "
                       "verifies", report.head(), report.method, printable(why))
            if report.strict:
                from .startup import fail_strict

                fail_strict(strict_error(f"verify: {report.prefix} {report.key}: no load check possible ({why}); "
                                         "refusing to start unverified"))
            return
        if not isinstance(out, torch.Tensor):
            logger.warning("%s: load check skipped (the method returned %s, not a tensor); live sampling "
                           "still verifies", report.head(), type(out).__name__)
            return
        with torch.no_grad():
            error = self._compare(x, out, topk=topk, logits=logits, input_ids=None, when="load")
        if error is not None and state.active:
            report.load_result(error, int(x.shape[0]))

    def get_fused_moe_quant_config(self, layer: Any) -> Any:
        return self._quantreg_inner.get_fused_moe_quant_config(layer)

    # -- the forward: a counter and a branch unless this call is verified -------------------------
    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts: Any = None, shared_experts_input: torch.Tensor | None = None) -> Any:
        state = self._quantreg_state
        state.calls += 1
        out = self._quantreg_inner.apply(layer=layer, x=x, topk_weights=topk_weights, topk_ids=topk_ids,
                                         shared_experts=shared_experts, shared_experts_input=shared_experts_input)
        if state.calls == state.next:
            self._verify(x, out, topk=(topk_weights, topk_ids))
        return out

    def apply_monolithic(self, layer: Any, x: torch.Tensor, router_logits: torch.Tensor,
                         input_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        state = self._quantreg_state
        state.calls += 1
        out = self._quantreg_inner.apply_monolithic(layer=layer, x=x, router_logits=router_logits,
                                                    input_ids=input_ids, **kwargs)
        if state.calls == state.next:
            self._verify(x, out, logits=router_logits, input_ids=input_ids)
        return out

    def _verify(self, x: torch.Tensor, out: Any, *, topk: tuple[torch.Tensor, torch.Tensor] | None = None,
                logits: torch.Tensor | None = None, input_ids: torch.Tensor | None = None) -> None:
        state, report = self._quantreg_state, self._quantreg_report
        call = state.calls
        state.next = self._quantreg_spec.next_call(call)
        if not state.active or state.shadow is None:
            return
        if not isinstance(out, torch.Tensor):
            state.active = False
            report.cannot(f"the method returned {type(out).__name__}, not a tensor (deferred finalisation)",
                          when="live")
            return
        try:
            finite = bool(torch.isfinite(x).all())
        except Exception:
            finite = False
        if not finite:  # e.g. a warm-up pass on uninitialised memory: nothing to compare
            logger.debug("%s: call %d: input not finite, not compared", report.head(), call)
            return
        error = self._compare(x, out, topk=topk, logits=logits, input_ids=input_ids, when="live")
        if error is not None:
            report.result(call, error)

    def _compare(self, x: torch.Tensor, out: torch.Tensor, *, topk: tuple[torch.Tensor, torch.Tensor] | None,
                 logits: torch.Tensor | None, input_ids: torch.Tensor | None, when: str) -> float | None:
        """The error of ``out`` against the ``against`` method's output, or ``None`` (verification now off).

        The boundary of the verifying side: the against method gets copies of the inputs and the
        shadow layer; whatever it raises (``SystemExit`` included) or returns that is not a finite
        tensor of ``out``'s shape turns verification of this layer off with one report.
        """
        why = None
        error = None
        try:
            ref = self._reference(x.clone(), None if topk is None else (topk[0].clone(), topk[1].clone()),
                                  None if logits is None else logits.clone(), input_ids)
            why = _unusable(ref, out)
            if why is None:
                hidden = out.shape[-1]
                error = relative_error(out.reshape(-1, hidden), ref.reshape(-1, hidden))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            why = f"{self._quantreg_report.against} raised {type(exc).__name__}: {exc}"
        if why is not None:
            self._quantreg_state.active = False
            self._quantreg_report.cannot(why, when=when)
            return None
        return error

    def _reference(self, x: torch.Tensor, topk: tuple[torch.Tensor, torch.Tensor] | None,
                   logits: torch.Tensor | None, input_ids: torch.Tensor | None) -> Any:
        shadow, against = self._quantreg_state.shadow, self._quantreg_against
        if isinstance(against, Float64Reference):
            if topk is None:
                assert logits is not None
                topk = against.route(shadow, logits)
            return against.run(shadow, x, *topk)
        if topk is not None:  # vLLM routed: the very ids and weights the chosen method got
            return against.apply(layer=shadow, x=x, topk_weights=topk[0], topk_ids=topk[1],
                                 shared_experts=None, shared_experts_input=None)
        if against.is_monolithic:  # both route inside, from the same logits
            return against.apply_monolithic(layer=shadow, x=x, router_logits=logits, input_ids=input_ids)
        assert logits is not None
        weights, ids = vllm_default_routing(shadow, logits)
        return against.apply(layer=shadow, x=x, topk_weights=weights, topk_ids=ids,
                             shared_experts=None, shared_experts_input=None)


def _unusable(ref: Any, out: torch.Tensor) -> str | None:
    """Why the against method's result cannot be compared with ``out`` (``None``: it can)."""
    if not isinstance(ref, torch.Tensor):
        return f"it returned {type(ref).__name__}, not a tensor"
    hidden = out.shape[-1] if out.dim() else 1
    if ref.dim() == 0 or ref.shape[-1] != hidden or ref.numel() != out.numel():
        return f"it returned shape {tuple(ref.shape)}, the chosen method {tuple(out.shape)}"
    if ref.is_complex() or not (ref.is_floating_point() or ref.dtype in (torch.int32, torch.int64)):
        return f"it returned dtype {ref.dtype}"
    if not bool(torch.isfinite(ref).all()):
        return "it returned non-finite values"
    return None


def build_against(spec: VerifySpec, decision: Decision, prefix: str, layer: Any, moe_config: Any,
                  registry: Registry | None = None) -> Any:
    """The ``against`` method for one layer, built the way the seam builds any method (:func:`.route.build`),
    with default options, from ``registry`` (the run's; ``None``: the process registry)."""
    if spec.against == FLOAT64:
        return Float64Reference()
    if registry is None:
        from ..registry import get_registry

        registry = get_registry()
    method = registry.methods.get(spec.against)
    if method is None:
        raise LookupError(f"method '{spec.against}' is not registered in this process")
    available = method.availability(decision.key.device)
    if not available.ok:
        raise RuntimeError(f"'{spec.against}' cannot run here: {available.reason}")
    context = BuildContext(decision.key, spec.against, decision.source, {}, prefix, layer)
    return build(method, moe_config, context, fused_moe_method_base())


_SEEN: dict[tuple[str, Key], set[int]] = {}
"""MoE layer indices built so far per (rule, key) in this process: what ``layers: N`` counts."""


def maybe_verify(method: Any, decision: Decision, prefix: str, layer: Any, moe_config: Any, mode: Mode,
                 registry: Registry | None = None) -> Any:
    """``method`` itself, or a :class:`VerifyingMethod` around it if the rule verifies this layer.

    Called by the seam right after the chosen method is built. A layer the rule does not cover is
    left exactly as it was (no wrapper, no cost). An ``against`` method that cannot be built is a
    WARNING and the chosen method runs unverified; in strict mode it is an error.
    """
    spec = decision.verify
    if spec is None:
        return method
    index = layer_index(prefix)
    seen = _SEEN.setdefault((decision.source, decision.key), set())
    if index is not None:
        seen.add(index)
    if not spec.covers(index, seen):
        return method
    report = _Report(prefix, decision.key, decision.method, spec.against, spec, mode.strict)
    try:
        against = build_against(spec, decision, prefix, layer, moe_config, registry)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit too: the verifying side never changes the chosen method
        report.cannot(f"building {spec.against} failed: {failure_text(exc)}", when="route")
        return method
    return VerifyingMethod(method, against, spec, report)
