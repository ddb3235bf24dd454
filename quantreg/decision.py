"""The answer to a key, with everything needed to explain it (including why each rule won or lost)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .keys import Key
from .methods import keeps_vllm
from .table.file import Rule, rule_json  # rule_json: re-exported (explain --json)

if TYPE_CHECKING:
    from .table.verify import VerifySpec

NOT_TRIED = "not tried"
"""How a chain step after the chosen one starts its reason."""


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

    def summary(self) -> str:
        """The one log line per key: ``(fmt, model, device) -> method [file:line]``."""
        text = f"{self.key} -> {self.method} [{self.source}]"
        if self.fallback:
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
            "chain": [
                {"method": s.method, "available": s.available, "reason": s.reason, "plugin": s.plugin}
                for s in self.chain
            ],
            "candidates": [
                {"rule": rule_json(c.rule), "won": c.won, "reason": c.reason} for c in self.candidates
            ],
        }

    def render(self) -> str:
        """Human-readable explanation for ``quantreg explain``."""
        lines = [f"key      {self.key}", f"method   {self.method}"]
        if self.rule is not None:
            lines.append(f"rule     {self.rule.location} ({self.rule.layer} layer) match {self.rule.match}")
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
                    f"  {mark} {r.location} [{r.layer}, specificity {r.match.specificity}, priority {r.priority}] "
                    f"{r.match} -> {', '.join(r.methods)}: {c.reason}"
                )
        return "\n".join(lines)


def why_won(winner: Rule, others: Sequence[Rule]) -> str:
    """Why the best matching rule beat the rest, in the documented precedence's words."""
    if not others:
        return "the only matching rule"
    return "highest precedence (layer, then specificity, then priority)"


def why_lost(rule: Rule, winner: Rule) -> str:
    """The first precedence step (layer, specificity, priority) where ``rule`` fell behind."""
    if rule.layer != winner.layer:
        return f"lower layer ({rule.layer} < {winner.layer})"
    if rule.match.specificity != winner.match.specificity:
        return f"less specific ({rule.match.specificity} < {winner.match.specificity} named fields)"
    return f"lower priority ({rule.priority} < {winner.priority})"
