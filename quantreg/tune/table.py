"""Writing the table ``quantreg tune`` produces: one user-table rule per key, evidence attached (no torch).

Why atomic: an operator points ``QUANTREG_CONFIG`` at this file; a half-written table (Ctrl-C,
a full disk) would be a fault in every vLLM process that reads it. The text goes to a temporary
file in the target's directory (same file system), is flushed and fsynced, then
``os.replace``-d over the target: readers see the old table or the new one, never a part.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ..keys import Key
from ..writing import replace_file
from .rank import PHASE_WEIGHTS, TOKENS, Result, Split, order_with_noise, ranked, split

HEADER = """\
# Written by `quantreg tune`: one rule per MoE key of the checkpoint, its chain ordered by measured
# speed on this host, fastest first; two methods apart only beyond the measured noise (tuned.ranking).
# Where the fastest method differs between small and large forwards beyond noise, two rules split the
# key by the forward's token count (tokens: "<=N" / ">N"; tuned.ranking says where and why).
# Score: {phase}. Start-up checks tuned.pins against the running host and builds.
# Only methods that matched the float64 reference within the tolerance are in a chain; `tuned:` keeps
# every measurement and why any method was refused, and `quantreg explain` shows it. Re-run tune after
# changing hardware, vLLM or plugins.
"""


def phase_text(weights: Mapping[int, float] = PHASE_WEIGHTS) -> str:
    """``decode-weighted geometric mean of median ms: 1 token 0.5, 64 tokens 0.25, 256 tokens 0.25``."""
    parts = ", ".join(f"{t} token{'s' if t != 1 else ''} {w:g}" for t, w in sorted(weights.items()))
    return f"geometric mean of median ms per forward weighted {parts}"


def rule_for(key: Key, results: Sequence[Result], evidence: Mapping[str, Any],
             weights: Mapping[int, float] = PHASE_WEIGHTS, prior: Sequence[str] = ()) -> dict[str, Any] | None:
    """The rule for ``key``, or ``None`` when no method passed (then no rule: the table's other layers decide).

    ``prior`` is the chain the key had before tune (ties within noise keep its order); the
    verdict on each neighbouring pair is written as ``tuned.ranking``.
    """
    passing, verdicts = order_with_noise(results, weights, prior)
    methods = [r.method for r in passing]
    if not methods:
        return None
    return {
        "match": {"quant_format": key.quant_format, "model_type": key.model_type, "device": key.device},
        "method": methods,
        "note": f"quantreg tune: fastest correct first, apart only beyond noise ({phase_text(weights)})",
        "tuned": {**evidence, "phase_weights": {str(t): w for t, w in sorted(weights.items())},
                  "ranking": [v.text() for v in verdicts],
                  "results": [r.to_json(weights) for r in ranked(results, weights, prior)]},
    }


class Quoted(str):
    """A string written in double quotes (``tokens: "<=8"`` and ``tokens: ">8"`` look alike in the table)."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(Quoted, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", str(v), style='"'))


def tokens_value(bound: int, small: bool) -> str:
    """The ``tokens`` match value of one side of a crossover at ``bound`` tokens: ``<=N`` or ``>N``."""
    return Quoted(f"<={bound}" if small else f">{bound}")


def tuned_rules(key: Key, results: Sequence[Result], evidence: Mapping[str, Any],
                weights: Mapping[int, float] = PHASE_WEIGHTS, prior: Sequence[str] = (),
                counts: Sequence[int] = TOKENS) -> tuple[list[dict[str, Any]], Split]:
    """The rules tune writes for ``key`` and the token-count decision behind them.

    One rule (:func:`rule_for`) unless :func:`quantreg.tune.rank.split` finds a crossover: then a
    pair, ``tokens: "<=N"`` to the small-forward winner and ``tokens: ">N"`` to the large-forward
    winner. Each side's chain is its winner, then the other passing methods ranked on that side's
    token counts alone (equal weights, apart only beyond noise; fallbacks where the winner cannot
    run). Both carry the whole evidence: the curve is every method's ``ms`` / ``spread`` at every
    count in ``tuned.results``, the crossover and its envelope check are lines of ``tuned.ranking``.
    """
    single = rule_for(key, results, evidence, weights, prior)
    if single is None:
        return [], split(results, counts, None)
    decided = split(results, counts, single["method"][0])
    cross = decided.crossover
    if cross is None:
        single["tuned"]["ranking"].append(decided.text())
        return [single], decided
    rules = []
    for small in (True, False):
        winner = cross.small if small else cross.large
        side = [t for t in decided.counts if (t <= cross.tokens) == small]
        side_weights = {t: 1.0 / len(side) for t in side}
        order, verdicts = order_with_noise(results, side_weights, [winner, *single["method"]])
        methods = [winner, *(r.method for r in order if r.method != winner)]
        other = cross.large if small else cross.small
        rules.append({
            "match": {"quant_format": key.quant_format, "model_type": key.model_type, "device": key.device,
                      "tokens": tokens_value(cross.tokens, small)},
            "method": methods,
            "note": (f"quantreg tune: {winner} for forwards of {'at most' if small else 'more than'} "
                     f"{cross.tokens} tokens, {other} {'above' if small else f'up to {cross.tokens}'} "
                     "(measured crossover; tuned.ranking)"),
            "tuned": {**copy.deepcopy(dict(evidence)),
                      "phase_weights": {str(t): round(w, 6) for t, w in sorted(side_weights.items())},
                      "ranking": [*(v.text() for v in verdicts), cross.text()],
                      "crossover": {"tokens": cross.tokens, "small": cross.small, "large": cross.large,
                                    "worst_ratio": round(cross.envelope.worst[1], 4),
                                    "worst_at": cross.envelope.worst[0]},
                      "results": [r.to_json(side_weights) for r in ranked(results, side_weights, methods)]},
        })
    return rules, decided


def render(rules: Sequence[Mapping[str, Any]], weights: Mapping[int, float] = PHASE_WEIGHTS) -> str:
    """The table's YAML text (a header comment, then ``version: 1`` and the rules)."""
    body = yaml.dump({"version": 1, "rules": [dict(r) for r in rules]}, Dumper=_Dumper, sort_keys=False,
                     default_flow_style=None, width=120, allow_unicode=False)
    return HEADER.format(phase=phase_text(weights)) + body


def write_atomically(path: str | os.PathLike[str], text: str) -> Path:
    """Replace ``path`` with ``text`` in one step through the one writer (:func:`quantreg.writing.replace_file`).

    A symlink at ``path`` is replaced, never followed; a device, FIFO, socket or directory is
    refused (:class:`quantreg.files.WriteRefused`), never replaced.
    """
    return replace_file(path, text, replace_symlink=True)
