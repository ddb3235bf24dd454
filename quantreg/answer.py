"""The one answer about a key: the decision, the notes that explain it, and what plugins say.

Why one module: ``explain``, ``plan``, ``doctor`` and the start-up decision line used to build
their own answers, and they disagreed (``plan`` re-derived what vllm-gaudi does while plugin
#1's keeper and ``doctor`` finding said the opposite). Every tool now calls :func:`answer`
(host facts are read by the checks it runs, through :func:`quantreg.host.host_facts`), so on
the same host, tables and key they print the same decision, the same notes and the same
findings; ``tests/test_answer.py`` holds them equal.

``notes`` is the one list of reasons per decision, in order: why methods of the chain were
passed over, the fallback, and vLLM's own limitation for a ``vllm`` decision. A new kind of
reason ("passed over because ...") is added here, and every tool shows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .decision import NOT_TRIED, ChainStep
from .keys import Key, as_key
from .methods import VLLM_METHOD

if TYPE_CHECKING:
    from .decision import Decision
    from .findings import Finding
    from .registry import Registry


@dataclass(frozen=True)
class Answer:
    """What every tool says about one key on this host."""

    decision: Decision
    notes: tuple[str, ...] = ()
    findings: tuple[Finding, ...] = ()
    vllm_limitation: str | None = None
    problems: tuple[str, ...] = ()  # faults met while answering (a plugin's bad limitation)

    @property
    def warns(self) -> bool:
        """Whether an operator should read this at WARNING: a fallback, a limitation, a plugin's warning."""
        return bool(any(s.decision.fallback or s.decision.stale for s in self.decision.sides)
                    or self.vllm_limitation
                    or any(f.level != "info" for f in self.findings))

    @property
    def warnings(self) -> list[str]:
        """The notes, a tuned rule's stale evidence and the plugins' non-info findings, as ``plan`` lists them."""
        stale = [s for side in self.decision.sides for s in side.decision.stale]  # every side of a split
        return [*self.notes, *(f"tuned rule is stale: {s}" for s in dict.fromkeys(stale)),
                *(str(f) for f in self.findings if f.level != "info")]

    def line(self) -> str:
        """The one line per key: what the start-up logs and the tools print as ``line``.

        The head of :meth:`Decision.summary`, then the notes, then the plugins' warnings and errors
        (their ``info`` findings stay in ``findings``: a line an operator scans should end on the
        decision when nothing needs doing)."""
        d = self.decision  # the fallback is among the notes
        parts = [d.head(), *self.notes,
                 *(str(f) for f in self.findings if f.level != "info")]
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {"line": self.line(), "notes": list(self.notes), "findings": [f.as_json() for f in self.findings],
                "vllm_limitation": self.vllm_limitation}


def chain_notes(decision: Decision) -> list[str]:
    """Why the chain went as it did: the fallback, then every chain entry (``available``,
    ``passed over: <why it cannot run here>``, or not tried) when any entry was passed over."""
    if not decision.fallback and not decision.passed_over:
        return []
    chain = "chain: " + "; ".join(f"{s.method}: {_step(s)}" for s in decision.chain)
    return [f"fallback: {decision.fallback}", chain] if decision.fallback else [chain]


def refused_notes(registry: Registry, decision: Decision) -> list[str]:
    """When the chosen method declares it cannot take the rule's option values (``Method.option_values``):
    a start-up cannot build it, and names what serves instead (the seams' walk, the same
    :meth:`~quantreg.registry.Registry.next_choices`), so ``explain`` names the method that will serve."""
    method = None if decision.keeps_vllm else registry.methods.get(decision.method)
    refused = None if method is None else method.refused_option(decision.options)
    if refused is None:
        return []
    for choice in registry.next_choices(decision):
        other = registry.methods.get(choice.method)
        if choice.keeps_vllm or other is None or other.refused_option(choice.options) is None:
            then = "vLLM's own method" if choice.keeps_vllm else f"'{choice.method}' [{choice.source}]"
            return [f"{refused}: it cannot be built, and the layer goes to {then}, the next method known to run here"]
    return [f"{refused}: it cannot be built, and no other method of the matching rules is known to run here: "
            "the layer goes to vLLM's own method"]


def _step(step: ChainStep) -> str:
    if step.available:
        return "available"
    return step.reason if step.reason.startswith(NOT_TRIED) else f"passed over: {step.reason}"


def answer(registry: Registry, key: Key | tuple[str, str, str], findings: Sequence[Finding] | None = None
           ) -> Answer:
    """Decide ``key`` with ``registry`` and gather everything said about it on this host.

    ``findings`` are the plugins' ``doctor_findings`` for the key's device when a caller already
    asked them (doctor, plan over devices); by default they are asked here, once per device and
    registry (:meth:`Registry.findings`).
    """
    key = as_key(key)
    decision = registry.resolve(key)
    if decision.split:  # each side's reasons, named by its token range
        notes = [f"tokens{s.tokens}: {n}" for s in decision.split for n in chain_notes(s.decision)]
    else:
        notes = chain_notes(decision)
    notes += [n for s in decision.sides for n in refused_notes(registry, s.decision)]
    limitation: str | None = None
    problems: tuple[str, ...] = ()
    if any(s.decision.keeps_vllm for s in decision.sides):
        limits, faults = registry.limitations()
        from .vllm_limits import vllm_backend_note

        limitation = vllm_backend_note(key, limits)
        problems = tuple(faults)
        if limitation:
            # Each reason once: when the chain already printed why vLLM's method cannot run, the
            # note only says it will fail, which rule left the key to vLLM and what would serve it.
            said_in_chain = any(s.method == VLLM_METHOD and not s.available for s in decision.chain)
            rule = (f"rule {decision.rule.location} leaves it to vLLM" if decision.rule is not None
                    else "no rule matches it, so vLLM keeps it")
            notes.append(f"vLLM's own method will fail for this key here ({rule}; why: the chain above). "
                         f"{registry.serving_advice(key)}" if said_in_chain
                         else f"{limitation} ({rule}). {registry.serving_advice(key)}")
    said = registry.findings(key.device) if findings is None else findings
    about = tuple(f for f in said if f.key == key)  # findings about no key are doctor's alone
    return Answer(decision, tuple(notes), about, limitation, problems)
