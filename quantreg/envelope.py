"""The ``--json`` envelope every ``quantreg`` command answers in: ``problems``, ``left_out``, ``vllm_would_refuse``.

Why one builder: a tool reading ``quantreg ... --json`` must find the same three keys, with
problems in the same form, whatever the command. Before, ``validate``, ``plan`` and
``check-method`` gave problem objects while ``explain``, ``list``, ``rules``, ``doctor`` and
``plugins`` gave strings, and ``tune``, ``tiny-model`` or ``new-plugin`` gave none (or no JSON
at all on failure). Every command now builds its JSON through :func:`envelope`, and
``tests/test_envelope_json.py`` checks each subcommand the parser knows against
:data:`ENVELOPE_SCHEMA`.

- ``problems``: objects ``{path, line, key, message, text}`` (:func:`problem_json`); ``text`` is
  the one line the terminal shows. A plugin failure adds ``plugin``.
- ``left_out``: table files a vLLM start-up with the same environment would leave out whole,
  ``{path, tier, problems}`` (how many problems that file has); ``layer`` repeats ``tier``, the
  name docs/operating.md documented before issue 47, for tools that read it.
- ``vllm_would_refuse``: ``vLLM would refuse to start (REASON): FAULT`` when strict mode is in
  force and something is wrong, else ``null``.

Commands that never read the tables (``tiny-model``, ``new-plugin``, ``schema``) answer with
``left_out: []`` and ``vllm_would_refuse: null``: they cannot make a start-up refuse.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from . import settings
from .builtin import default_table_path
from .loading import config_paths
from .problems import printable, problem_json
from .table.file import Tier

if TYPE_CHECKING:
    from .decision import Decision
    from .registry import Registry

KEYS = ("problems", "left_out", "vllm_would_refuse")
"""The envelope's keys, in every ``--json`` answer."""

PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["path", "line", "key", "message", "text"],
    "properties": {
        "path": {"type": ["string", "null"]},
        "line": {"type": ["integer", "null"], "minimum": 1},
        "key": {"type": "string"},
        "message": {"type": "string", "minLength": 1},
        "text": {"type": "string", "minLength": 1},
        "plugin": {"type": "string"},
    },
}
"""JSON Schema of one problem object (the documented form; the envelope test validates against it)."""

ENVELOPE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": list(KEYS),
    "properties": {
        "problems": {"type": "array", "items": PROBLEM_SCHEMA},
        "left_out": {"type": "array", "items": {
            "type": "object", "required": ["path", "tier", "layer", "problems"], "additionalProperties": False,
            "properties": {"path": {"type": "string"}, "tier": {"enum": [str(t) for t in Tier]},
                           "layer": {"enum": [str(t) for t in Tier]},
                           "problems": {"type": "integer", "minimum": 1}}}},
        "vllm_would_refuse": {"type": ["string", "null"], "pattern": "^vLLM would refuse to start \\("},
    },
}
"""JSON Schema of the envelope part of every ``--json`` answer (other keys are the command's own)."""


def left_out(registry: Registry, config: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Table files a start-up would leave out whole, with their tier and how many problems each has.

    Both files of an ambiguous pair are left out while the problem is reported once, at the later rule:
    the other file counts the problems that name it (before, ``left_out`` named one of the two files).
    """
    counts = Counter(p.path for p in registry.problems if p.path != settings.ENVIRONMENT)
    kept = {t.path for t in registry.tables}
    for header in registry.headers:  # dropped for another file's problem: the earlier rule of an ambiguous pair
        if header.path not in kept and header.path not in counts:
            named = sum(1 for p in registry.problems if f"{header.path}:" in p.message)
            if named:
                counts[header.path] = named
    tiers = {h.path: str(h.tier) for h in registry.headers}
    tiers.setdefault(str(default_table_path()), str(Tier.DEFAULT))
    for path in config_paths(os.environ):
        tiers.setdefault(path, str(Tier.USER))
    for path in config:
        tiers.setdefault(os.fspath(path), str(Tier.RUN))
    return [{"path": path, "tier": (tier := tiers.get(path, str(Tier.PLUGIN))), "layer": tier, "problems": n}
            for path, n in counts.items()]


def left_out_lines(files: Sequence[dict[str, Any]]) -> list[str]:
    """The terminal's form of :func:`left_out`: ``  user    broken.yaml LEFT OUT: 1 problem``."""
    return [f"  {f['tier']:<7} {printable(f['path'])} LEFT OUT: {f['problems']} problem"
            + ("s" if f["problems"] != 1 else "") for f in files]


def refusal(registry: Registry, decision: Decision | None = None) -> str | None:
    """``vLLM would refuse to start: ...`` when strict mode is in force and something is wrong, else ``None``.

    ``decision``: a chain that fell back (nothing available) counts too, as it does at start-up, on every
    side of a split (the seam refuses a split whose second side has no runnable method); so does a
    tuned rule whose pins do not match this process (strict start-up refuses it at the first layer).
    """
    mode = registry.mode()
    if not mode.strict:
        return None
    faults = [str(f) for f in registry.faults]
    if decision is not None:  # every side of a split, as the seam refuses it (Decision.unrunnable)
        for side in decision.unrunnable:
            which = f" for tokens{side.tokens}" if decision.split else ""
            faults.append(f"{decision.key} -> {side.decision.method}{which} [{side.decision.source}] (fallback: "
                          f"{side.decision.fallback}) (at the first layer with this key)")
        stale = [text for side in decision.sides for text in side.decision.stale]
        if stale:  # strict start-up refuses a stale tuned pin (quantreg.vllm.route): so does every tool
            faults.append(f"tuned rule for {decision.key} was measured elsewhere: "
                          + "; ".join(dict.fromkeys(printable(t) for t in stale)))
    if not faults:
        return None
    more = f" (and {len(faults) - 1} more)" if len(faults) > 1 else ""
    return f"vLLM would refuse to start ({'; '.join(mode.because)}): {faults[0]}{more}"


def envelope(problems: Iterable[object] | None = None, registry: Registry | None = None,
             config: Sequence[str] = (), decision: Decision | None = None) -> dict[str, Any]:
    """The three keys for a command's JSON answer.

    ``problems``: what the command found (table problems, plugin failures, checkpoint problems,
    its own refusal), each turned into an object by :func:`problem_json`; ``None`` means the
    registry's faults. ``registry`` (absent for commands that never read the tables) gives
    ``left_out`` and ``vllm_would_refuse``; ``config`` are the command's ``--config`` files (the
    run tier); ``decision`` is the answer's decision, whose fallback strict mode refuses.
    """
    shown = list(registry.faults if registry is not None else ()) if problems is None else list(problems)
    return {"problems": [problem_json(p) for p in shown],
            "left_out": left_out(registry, config) if registry is not None else [],
            "vllm_would_refuse": refusal(registry, decision) if registry is not None else None}
