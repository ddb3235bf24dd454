"""Errors as values: every fault in a table or a plugin becomes a located :class:`Problem`.

Loaders collect problems instead of raising, so one run reports everything wrong at once and
the caller (CLI, vLLM seam) decides whether a problem is fatal. Nothing is half-applied: a
source with problems contributes no rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One fault, printed as ``FILE:LINE: KEY: message``."""

    path: str
    line: int | None
    key: str
    message: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line is not None else self.path
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class QuantregError(Exception):
    """Raised at the edges (strict mode, the vLLM seam) with every problem in its message."""

    def __init__(self, problems: Sequence[Problem] | str) -> None:
        self.problems: tuple[Problem, ...] = (
            () if isinstance(problems, str) else tuple(problems)
        )
        text = problems if isinstance(problems, str) else "\n".join(map(str, problems))
        super().__init__(text)


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """A ``; did you mean 'x'?`` suffix, or nothing when no choice is close."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""
