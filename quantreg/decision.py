"""The answer to a key, with everything needed to explain it (including why each rule won or lost)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .keys import Key, TokenRange
from .methods import keeps_vllm
from .table.file import Rule, rule_json  # rule_json: re-exported (explain --json)

if TYPE_CHECKING:
    from .table.verify import VerifySpec

NOT_TRIED = "not tried"
"""How a chain step after the chosen one starts its reason."""

OUT_OF_RANGE = "its range tokens"
"""How a candidate rule whose ``tokens:`` range does not cover the decision's counts starts its reason."""


@dataclass(frozen=True)
class ChainStep:
    """One method of the winning rule's chain and whether it can run here."""

    method: str
    available: bool
    reason: str
    plugin: str = ""


@dataclass(frozen=True)
class Candidate:
    """A rule that matched the key, and why it won or lost."""

    rule: Rule
    won: bool
    reason: str


@dataclass(frozen=True)
class TokenSide:
    """One side of a split decision: the forward token counts ``tokens`` and the decision for them."""

    tokens: TokenRange
    decision: Decision

    def to_json(self) -> dict[str, Any]:
        d = self.decision
        return {"tokens": str(self.tokens), "low": self.tokens.low, "high": self.tokens.high, "method": d.method,
                "rule": rule_json(d.rule) if d.rule is not None else None, "options": dict(d.options),
                "fallback": d.fallback, "chain": [{"method": s.method, "available": s.available, "reason": s.reason,
                                                   "plugin": s.plugin} for s in d.chain]}


@dataclass(frozen=True)
class Decision:
    """Which method runs for ``key`` and why.

    ``method`` is the chosen name (``"vllm"`` keeps vLLM's own choice). ``fallback`` is set when
    nothing the table asked for can run here and vLLM's own method is used instead. ``host`` is
    :meth:`quantreg.host.HostFacts.as_json` of the host that decided (the audit trail records it:
    chains are host-aware, so the same table can decide differently on another host).
    """

    key: Key
    method: str
    rule: Rule | None
    options: Mapping[str, Any]
    candidates: tuple[Candidate, ...]
    chain: tuple[ChainStep, ...]
    fallback: str | None = None
    host: Mapping[str, Any] | None = field(default=None, compare=False)
    stale: tuple[str, ...] = field(default=(), compare=False)
    """The winning rule's ``tuned.pins`` fields this process differs in (:mod:`quantreg.pins`), each
    "FIELD: tuned with X, running Y": the rule still decides (lenient), the flag travels with it."""
    split: tuple[TokenSide, ...] = ()
    """Set when rules with ``tokens:`` ranges decide this key differently per forward token count:
    every side, lowest counts first (they partition 1..inf). The fields above are then those of the
    first side (the smallest forwards, decode), so a reader that knows no split still reads a real
    decision; the seam, ``explain``, ``plan`` and the trail read every side."""

    @property
    def passed_over(self) -> tuple[ChainStep, ...]:
        """The chain entries before the chosen one that could not run here (each with its reason)."""
        return tuple(s for s in self.chain if not s.available and not s.reason.startswith(NOT_TRIED))

    @property
    def keeps_vllm(self) -> bool:
        """vLLM builds its own method for this key (the built-in ``vllm`` method was chosen)."""
        return keeps_vllm(self.method)

    @property
    def verify(self) -> VerifySpec | None:
        """The winning rule's ``verify:``, when the chosen method is one quantreg builds (not ``vllm``)."""
        if self.rule is None or self.keeps_vllm:
            return None
        return self.rule.verify

    @property
    def source(self) -> str:
        return self.rule.location if self.rule is not None else "no rule"

    @property
    def sides(self) -> tuple[TokenSide, ...]:
        """Every side (one side covering every token count when the decision is not split)."""
        return self.split or (TokenSide(TokenRange(), self),)

    @property
    def is_split(self) -> bool:
        """More than one method object per layer: sides differ in method, options or ``verify:``.

        ``verify:`` counts: two sides sharing a method but not a ``verify:`` are two method objects (one
        verified), so neither side's ``verify:`` is dropped (one object would carry only the first side's).
        """
        return len({(s.decision.method, repr(sorted(s.decision.options.items())), repr(s.decision.verify))
                    for s in self.split}) > 1

    @property
    def unrunnable(self) -> tuple[TokenSide, ...]:
        """The sides (every one, not only the first) whose chain has no method that can run here.

        What strict mode refuses: the seam at the first layer, and every tool's start-up verdict
        (:func:`quantreg.envelope.refusal`), from this one reading of the decision.
        """
        return tuple(s for s in self.sides if s.decision.fallback)

    def methods_text(self) -> str:
        """The method of every side: ``m`` or ``m1 for tokens<=32, m2 for tokens>32`` (explain, plan, the trail)."""
        return sides_text([(s.decision.method, str(s.tokens)) for s in self.split]) if self.split else self.method

    def head(self) -> str:
        """``(fmt, model, device) -> method [file:line]``; a split names each side with its token range."""
        if not self.split:
            return f"{self.key} -> {self.method} [{self.source}]"
        return f"{self.key} -> " + ", ".join(f"{s.decision.method} for tokens{s.tokens} [{s.decision.source}]"
                                             for s in self.split)

    def summary(self) -> str:
        """The one log line per key: ``(fmt, model, device) -> method [file:line]``."""
        text = self.head()
        if self.split:  # every side's fallback, named by its range (the first side's alone hid the others')
            text += "".join(f" (fallback for tokens{s.tokens}: {s.decision.fallback})" for s in self.unrunnable)
        elif self.fallback:
            text += f" (fallback: {self.fallback})"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key.as_json(),
            "method": self.method,
            "rule": rule_json(self.rule) if self.rule is not None else None,
            "options": dict(self.options),
            "fallback": self.fallback,
            "host": dict(self.host) if self.host is not None else None,
            **({"stale": list(self.stale)} if self.stale else {}),
            **({"split": [s.to_json() for s in self.split]} if self.split else {}),
            "chain": [
                {"method": s.method, "available": s.available, "reason": s.reason, "plugin": s.plugin}
                for s in self.chain
            ],
            "candidates": [
                {"rule": rule_json(c.rule), "won": c.won, "reason": c.reason} for c in self.candidates
            ],
        }

    def render(self) -> str:
        """Human-readable explanation for ``quantreg explain``; a split explains each side in turn."""
        if self.split:
            lines = [f"key      {self.key}", f"method   {self.methods_text()}",
                     "split    per forward, by its token count (the rules' tokens: ranges); "
                     + ("one method object per layer holds every side" if self.is_split
                        else "every side chose the same method, options and verify: one method, no dispatch")]
            if self.is_split:
                lines.append("memory   every side holds the experts in its own form; a side that cannot share the "
                             "loaded weights (another side repacks them in place) gets a copy: at most one copy of "
                             "the packed experts per extra side (quantreg plan: bytes; the load line: what it took)")
            for side in self.split:
                lines.append(f"-- tokens{side.tokens} (forwards of {_count_words(side.tokens)})")
                lines += ["   " + line for line in replace(side.decision, split=()).render().splitlines()[1:]]
            return "\n".join(lines)
        lines = [f"key      {self.key}", f"method   {self.method}"]
        if self.rule is not None:
            lines.append(f"rule     {self.rule.location} ({self.rule.tier_label}) match {self.rule.match}")
            if self.rule.note:
                lines.append(f"note     {self.rule.note}")
        else:
            lines.append("rule     none matched: vLLM keeps its own method")
        if self.options:
            lines.append(f"options  {dict(self.options)}")
        if self.verify is not None:
            lines.append(f"verify   {self.method} {self.verify.plan()}")
        if self.rule is not None and self.rule.tuned is not None:
            lines.append(f"tuned    {self.rule.tuned.summary(self.method)}")
        for stale in self.stale:
            lines.append(f"STALE    tuned evidence does not match this process: {stale}")
        if self.fallback:
            lines.append(f"fallback {self.fallback}")
        if self.chain:
            lines.append("chain")
            for step in self.chain:
                mark = "yes" if step.available else "no "
                why = step.reason
                if not step.available and not why.startswith(NOT_TRIED):
                    why = f"passed over: {why}"
                lines.append(f"  {mark} {step.method}: {why}")
            if self.host is not None and self.passed_over:
                lines.append(f"host     {self.host.get('kind')} ({', '.join(map(str, self.host.get('flags') or []))})"
                             + (" [simulated]" if self.host.get("simulated") else ""))
        if self.candidates:
            lines.append("matching rules, best first")
            for c in self.candidates:
                mark = "WON " if c.won else "lost"
                r = c.rule
                lines.append(
                    f"  {mark} {r.location} [{r.tier_label}, specificity {r.match.specificity}, priority {r.priority}] "
                    f"{r.match} -> {', '.join(r.methods)}: {c.reason}"
                )
        return "\n".join(lines)


def sides_text(sides: Sequence[tuple[str, str]]) -> str:
    """``(method, tokens range)`` of each side as one value: ``m1 for tokens<=32, m2 for tokens>32``.

    The one spelling of a split decision's methods, so a reader comparing two processes (``doctor
    --decisions``) compares every side, and two readers never spell one decision two ways.
    """
    return ", ".join(f"{method} for tokens{tokens}" for method, tokens in sides)


def _count_words(tokens: TokenRange) -> str:
    if tokens.high is None:
        return f"{tokens.low} tokens or more"
    return f"{tokens.low} to {tokens.high} tokens" if tokens.low > 1 else f"at most {tokens.high} tokens"


def why_won(winner: Rule, others: Sequence[Rule]) -> str:
    """Why the best matching rule beat the rest, in the documented precedence's words."""
    if not others:
        return "the only matching rule"
    return "highest precedence (tier, then specificity, then priority)"


def why_lost(rule: Rule, winner: Rule) -> str:
    """The first precedence step (tier, specificity, priority) where ``rule`` fell behind."""
    if rule.tier != winner.tier:
        return f"lower tier ({rule.tier} < {winner.tier})"
    if rule.match.specificity != winner.match.specificity:
        if rule.match.tokens is None and winner.match.tokens is not None and rule.match.specificity + 1 == \
                winner.match.specificity:
            return f"less specific ({rule.match.specificity} < {winner.match.specificity} named fields: the winner "\
                   f"names tokens{winner.match.tokens})"
        return f"less specific ({rule.match.specificity} < {winner.match.specificity} named fields)"
    return f"lower priority ({rule.priority} < {winner.priority})"
