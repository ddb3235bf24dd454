"""One method object per layer that serves each forward by its token count (``tokens:`` rules, issue 32).

Why one object: vLLM builds a layer's quant method once and then calls it for every forward, decode
(a few tokens) and prefill (hundreds) alike; kernels have crossovers (a GEMV path that wins at one
token, a GEMM path that wins at 256). When the rules of a key differ by their token range,
:meth:`quantreg.registry.Registry.resolve` returns a split decision and the seam installs a
:class:`TokenSplitMethod` holding every side's method. To vLLM it *is* the first side's method
(every attribute, ``__class__`` included: the one proxy base, :mod:`.proxy`),
except at these points:

* ``create_weights`` runs the first side's ``create_weights`` on the real layer and each other
  side's on a scratch copy on the meta device (nothing allocated), to learn which parameters it
  reads and check that their shapes and dtypes are the ones the first side created (vLLM's
  loader fills only the real layer);
* ``process_weights_after_loading`` gives each side the weights in the form it expects: the first
  side processes the real layer; every other side processes a *shadow* (a shallow copy of the
  layer with parameters of its own). A shadow shares the loaded parameter objects while no side
  changes them in place (a side that repacks into new tensors, or binds views, leaves them as
  loaded, as both plugins of this repository and vLLM 0.32's own CPU MXFP4 method do; see
  docs/tables.md); where one side transformed them in place, the other side gets its own copy.
  Which happened, and the bytes it costs (copied, and loaded weights kept alive for a side after
  the first side dropped them), is logged per layer at load and written to the trail
  (``event: split_load``);
* ``apply`` / ``apply_monolithic`` pick the side by the number of tokens in the hidden states
  (one ``bisect`` over the sides' upper bounds) and call it with its layer or shadow. The first
  forward of each side per layer writes one ``event: split_forward`` trail line naming the method,
  the range and the forward's token count; every later forward costs the bisect and one list read.

Contained like every decision: a side that cannot be built, whose layout differs, whose
``process_weights_after_loading`` raises, or whose weights for this layer (copied, or loaded weights
kept alive) would leave less memory available than ``QUANTREG_SPLIT_MEMORY_RESERVE`` (4 GiB by
default: a split costs its bytes once per MoE layer, and a whole GPT-OSS-20B split between a plugin
that repacks and one that reads the loaded form kept 0.4 GiB alive per layer, 9.5 GiB in all, and
was killed by the kernel's OOM killer on a 24 GB host) is dropped with one WARNING and the
remaining side serves its token counts (lenient); strict refuses the start with one
``quantreg (strict):`` line. A side that raises on a live forward is turned off the same way
(lenient: that forward and the later ones of its range go to the first side; strict: an ERROR line,
never a raise mid-request, as ``verify:``).
"""

from __future__ import annotations

import logging
import os
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

from .. import settings
from ..decision import Decision
from ..host import memory_available
from ..keys import Key, TokenRange
from ..problems import QuantregError, printable, quantreg_logger, strict_error
from .proxy import Proxy
from .route import failure_text
from .shadow import fault_of, layer_copy, probe_weights

logger = quantreg_logger("vllm.quantreg.split")

@dataclass
class Side:
    """One side of the split: its token range, its decision and its method object."""

    tokens: TokenRange
    decision: Decision
    method: Any
    layer: Any = None  # the real layer (first side) or its shadow, set at load
    reads: tuple[str, ...] = ()
    extras: dict[str, Any] | None = None
    seen: bool = False  # its first forward in this layer was recorded

    @property
    def name(self) -> str:
        return self.decision.method


def _trail(record: dict[str, Any]) -> None:
    from ..audit import append_record, utc_time

    append_record({"time": utc_time(), "pid": os.getpid(), **record})


class _Report:
    """Who is split, and how a side's failure is reported (lenient WARNING, strict refusal)."""

    def __init__(self, prefix: str, key: Key, strict: bool) -> None:
        self.prefix, self.key, self.strict = prefix, key, strict

    def drop(self, side: Side, why: str, serving: Side, *, when: str) -> None:
        text = (f"quantreg: {self.prefix} {self.key}: '{side.name}' for tokens{side.tokens} {why}; "
                f"'{serving.name}' serves those forwards")
        if self.strict and when != "live":
            from .startup import fail_strict

            fail_strict(strict_error(text))
        logger.log(logging.ERROR if self.strict else logging.WARNING, "%s", printable(text))


class TokenSplitMethod(Proxy, FusedMoEMethodBase, forwards=FusedMoEMethodBase):  # type: ignore[misc]
    """The first side's method to vLLM (:class:`.proxy.Proxy`); each forward served by the side whose range
    holds its token count."""

    _quantreg_own = frozenset({"_quantreg_sides", "_quantreg_bounds", "_quantreg_report", "_quantreg_monolithic"})

    def __init__(self, sides: Sequence[Side], report: _Report) -> None:
        self._quantreg_sides = list(sides)
        self._quantreg_report = report
        self._quantreg_bounds: list[int | None] = []
        self._quantreg_monolithic: bool | None = None
        self._rebound()

    def _quantreg_target(self) -> Any:
        return self._quantreg_sides[0].method

    @property
    def quantreg_split(self) -> tuple[tuple[str, str], ...]:
        """(range, method) per side still serving: for tests and diagnostics."""
        return tuple((str(s.tokens), s.name) for s in self._quantreg_sides)

    def _rebound(self) -> None:
        """Recompute the dispatch table after a side was dropped: its range goes to a neighbour."""
        sides = self._quantreg_sides
        merged: list[Side] = []
        for side in sides:
            if merged and merged[-1].method is side.method:
                merged[-1].tokens = TokenRange(merged[-1].tokens.low, side.tokens.high)
                continue
            merged.append(side)
        self._quantreg_sides = merged
        self._quantreg_bounds = [s.tokens.high for s in merged[:-1]]

    def _drop(self, index: int, why: str, when: str) -> None:
        """Side ``index`` stops serving: the first side (or, for the first, the second) takes its range."""
        sides = self._quantreg_sides
        side = sides[index]
        serving = sides[0] if index else sides[1]
        self._quantreg_report.drop(side, why, serving, when=when)
        if index == 0:  # the first side is vLLM's view of the method; keep it, serve its range by the next
            serving.tokens = TokenRange(1, serving.tokens.high)
            sides[0] = Side(side.tokens, serving.decision, serving.method, serving.layer, serving.reads,
                            serving.extras, serving.seen)
        else:
            sides[index] = Side(side.tokens, serving.decision, serving.method, serving.layer, serving.reads,
                                serving.extras, serving.seen)
        self._rebound()

    # -- the lifecycle --------------------------------------------------------------------------
    def create_weights(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
        sides = self._quantreg_sides
        result = sides[0].method.create_weights(layer, *args, **kwargs)
        for i in range(len(sides) - 1, 0, -1):
            side = sides[i]

            def probe(side: Side = side) -> None:
                side.reads, side.extras = probe_weights(side.method, layer, *args, **kwargs)

            fault = fault_of(probe)
            if fault is not None:
                self._drop(i, f"cannot share this layer's weights ({type(fault).__name__}: {fault})", "load")
        return result

    def process_weights_after_loading(self, layer: Any) -> None:
        sides = self._quantreg_sides
        reads = sorted({n for s in sides[1:] for n in s.reads})
        originals = {n: layer._parameters[n] for n in reads if layer._parameters.get(n) is not None}
        # a temporary copy: to learn whether a side changed the loaded weights in place, and to give
        # the other side its own copy when it did (dropped at the end when nobody needs it)
        pristine = {n: p.data.clone() for n, p in originals.items()}
        sides[0].layer = layer
        sides[0].method.process_weights_after_loading(layer)
        changed = {n for n, p in originals.items() if not _same(p, pristine[n])}
        copied = kept = 0
        for i in range(len(sides) - 1, 0, -1):
            side = sides[i]
            if side.method is sides[0].method:
                continue
            loaded = [self._shadow(layer, side, originals, pristine, changed)]

            def load(side: Side = side, loaded: list[tuple[Any, set[str]]] = loaded) -> None:
                shadow, own = loaded[0]
                side.method.process_weights_after_loading(shadow)
                spoiled = {n for n in side.reads if n in originals and n not in own
                           and not _same(originals[n], pristine[n])}
                if spoiled:  # this side changed shared weights in place: restore them, give it its own copy
                    for n in spoiled:
                        originals[n].data.copy_(pristine[n])
                    loaded[0] = self._shadow(layer, side, originals, pristine, changed | spoiled)
                    side.method.process_weights_after_loading(loaded[0][0])

            fault = fault_of(load)
            if fault is not None:
                self._drop(i, f"raised in process_weights_after_loading ({type(fault).__name__}: {fault})", "load")
                continue
            shadow, own = loaded[0]
            side_copied = sum(_nbytes(shadow._parameters[n]) for n in own)
            side_kept = sum(_nbytes(originals[n]) for n in side.reads
                            if n in originals and n not in own and layer._parameters.get(n) is not originals[n])
            short = _memory_short(side_copied + side_kept)
            if short is not None:
                del shadow, loaded[:]  # the side's weights go with it (the drop below serves its range)
                self._drop(i, short, "load")
                continue
            side.layer = shadow
            copied += side_copied
            kept += side_kept
        pristine.clear()
        originals.clear()  # a dropped side's weights are freed now, before the line below reports memory
        self._quantreg_sides[0].layer = layer
        self._quantreg_monolithic = None
        report = self._quantreg_report
        how = ("own copy of the loaded weights" if copied else "shares the loaded weights")
        shown = ", ".join(f"{s.name} for tokens{s.tokens}" for s in self._quantreg_sides)
        available = memory_available()
        logger.info("quantreg: %s %s: split %s; the other side %s: %.2f MiB copied, %.2f MiB kept alive for it "
                    "(%s GiB of memory available after)", report.prefix, report.key, shown, how, copied / 2**20,
                    kept / 2**20, "?" if available is None else f"{available / 2**30:.1f}")
        if _trail_on():
            _trail({"event": "split_load", "prefix": report.prefix, "key": report.key.as_json(),
                    "sides": [{"tokens": str(s.tokens), "method": s.name} for s in self._quantreg_sides],
                    "copied_bytes": copied, "kept_bytes": kept})

    def _shadow(self, layer: Any, side: Side, originals: dict[str, Any], pristine: dict[str, torch.Tensor],
                changed: set[str]) -> tuple[Any, set[str]]:
        """A shadow of ``layer`` for ``side``: the loaded parameters shared, or copied where ``changed``."""
        shadow = layer_copy(layer)
        own: set[str] = set()
        for name in side.reads:
            if name not in originals:
                continue
            if name in changed:
                param = torch.nn.Parameter(pristine[name].clone(), requires_grad=False)
                param.__dict__.update({k: v for k, v in originals[name].__dict__.items() if k != "_cdata"})
                shadow._parameters[name] = param
                own.add(name)
            else:
                shadow._parameters[name] = originals[name]
        shadow.__dict__.update(side.extras or {})
        shadow.__dict__["quant_method"] = side.method
        return shadow, own

    def get_fused_moe_quant_config(self, layer: Any) -> Any:
        return self._quantreg_sides[0].method.get_fused_moe_quant_config(layer)

    @property
    def is_monolithic(self) -> bool:
        """Monolithic only when every side routes inside: else vLLM routes and each side gets its choice."""
        known: bool | None = self._quantreg_monolithic
        if known is None:
            known = all(bool(s.method.is_monolithic) for s in self._quantreg_sides)
            if self._quantreg_sides[0].layer is not None:  # after loading the answer is fixed
                self._quantreg_monolithic = known
        return known

    # -- the forward: one bisect, then the side ---------------------------------------------------
    def _side_for(self, x: torch.Tensor) -> Side:
        """The side whose token range holds this forward's token count (rows of ``x``; a 3-D ``x`` is
        flattened), after its first-forward trail line; the only per-forward cost of the split."""
        shape = x.shape
        side = self._quantreg_sides[bisect_left(self._quantreg_bounds,
                                                shape[0] if len(shape) == 2 else x.numel() // shape[-1])]
        return side if side.seen else self._first(side, x)

    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts: Any = None, shared_experts_input: torch.Tensor | None = None) -> Any:
        side = self._side_for(x)
        try:
            return side.method.apply(layer=side.layer if side.layer is not None else layer, x=x,
                                     topk_weights=topk_weights, topk_ids=topk_ids, shared_experts=shared_experts,
                                     shared_experts_input=shared_experts_input)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            if not self._live_failure(side, exc):
                raise
            return self.apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)

    def apply_monolithic(self, layer: Any, x: torch.Tensor, router_logits: torch.Tensor,
                         input_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        side = self._side_for(x)
        try:
            return side.method.apply_monolithic(layer=side.layer if side.layer is not None else layer, x=x,
                                                router_logits=router_logits, input_ids=input_ids, **kwargs)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            if not self._live_failure(side, exc):
                raise
            return self.apply_monolithic(layer, x, router_logits, input_ids, **kwargs)

    def _first(self, side: Side, x: torch.Tensor) -> Side:
        """The first forward a side serves in this layer: one trail line (the trail shows both sides)."""
        side.seen = True
        tokens = int(x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1])
        report = self._quantreg_report
        logger.debug("quantreg: %s %s: first forward of %d tokens served by %s (tokens%s)",
                     report.prefix, report.key, tokens, side.name, side.tokens)
        if _trail_on():
            try:
                _trail({"event": "split_forward", "prefix": report.prefix, "key": report.key.as_json(),
                        "method": side.name, "tokens": str(side.tokens), "forward_tokens": tokens,
                        "rule": side.decision.source})
            except Exception as exc:  # the trail is best effort: never take a forward down
                logger.warning("quantreg: split trail line not recorded: %s: %s", type(exc).__name__, exc)
        return side

    def _live_failure(self, side: Side, exc: BaseException) -> bool:
        """A side raised on a live forward: drop it (its range goes to the other side) and retry; False
        when it is the last side (its error is then the forward's own, as for any single method)."""
        sides = self._quantreg_sides
        if len(sides) < 2:
            return False
        index = next(i for i, s in enumerate(sides) if s is side)
        self._drop(index, f"raised on a forward ({type(exc).__name__}: {exc})", "live")
        return True


def _same(param: Any, pristine: torch.Tensor) -> bool:
    data = param.data
    return bool(data.shape == pristine.shape and data.dtype == pristine.dtype and torch.equal(data, pristine))


def _memory_short(cost: int) -> str | None:
    """Why holding ``cost`` more bytes for a side is refused (available memory under the reserve), or None."""
    reserve = float(settings.value(settings.SPLIT_MEMORY_RESERVE))
    if not cost or reserve <= 0:
        return None
    available = memory_available()
    if available is None or available >= reserve * 2**30:
        return None
    return (f"is not kept: its {cost / 2**20:.0f} MiB of weights for this layer would leave "
            f"{available / 2**30:.1f} GiB of memory available, under {settings.SPLIT_MEMORY_RESERVE}="
            f"{reserve:g} GiB (a split holds its weights once per MoE layer)")


def _nbytes(param: Any) -> int:
    return int(param.numel() * param.element_size())


def _trail_on() -> bool:
    from .startup import _trail_asked_for

    return bool(_trail_asked_for())


def build_split(decision: Decision, build: Callable[[Decision, str], tuple[Decision, Any]], prefix: str,
                strict: bool) -> Any:
    """The method for a split decision: a :class:`TokenSplitMethod`, or one method when only one side builds.

    ``build`` makes one side's method from its decision and token range, down the side's walk
    (:meth:`.route.Route.split_side`: a method that cannot be built hands the side to the next one
    known to run), and returns the decision that serves it with the method (``verify:`` included).
    A side whose build still raises (its ``verify:`` wrapper, vLLM's own method) is dropped (lenient,
    one WARNING) or refuses the start (strict: its ``QuantregError`` passes). Raises when no side
    builds (the seam then falls back as for any method).
    """
    sides: list[Side] = []
    failed: list[tuple[Side, str]] = []
    for token_side in decision.split:
        side = Side(token_side.tokens, token_side.decision, None)
        try:
            side.decision, side.method = build(token_side.decision, str(token_side.tokens))
        except QuantregError:
            raise
        except Exception as exc:
            if strict:
                raise strict_error(f"{prefix} {decision.key}: method '{side.name}' for tokens{side.tokens} could "
                                   f"not be built: {failure_text(exc)}") from exc
            failed.append((side, failure_text(exc)))
            continue
        sides.append(side)
    if not sides:
        raise RuntimeError("no side of the split could be built: " + "; ".join(f"{s.name}: {w}" for s, w in failed))
    report = _Report(prefix, decision.key, strict)
    for side, why in failed:
        logger.warning("quantreg: %s %s: '%s' for tokens%s could not be built (%s); '%s' serves those forwards",
                       prefix, decision.key, side.name, side.tokens, printable(why), sides[0].name)
    if len(sides) == 1:
        return sides[0].method
    # the failed sides' ranges: the neighbouring built side takes them (ranges stay a partition)
    for j, side in enumerate(sides):
        low = 1 if j == 0 else sides[j - 1].tokens.high + 1  # type: ignore[operator]
        high = side.tokens.high if j + 1 < len(sides) else None
        side.tokens = TokenRange(low, high)
    return TokenSplitMethod(sides, report)
