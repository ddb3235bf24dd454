"""Strict or lenient: the one decision of how faults are treated, made in one place.

Strict mode makes every fault fatal at vLLM start-up; lenient logs it and carries on without the
faulty file or plugin. Any one of these asks for strict, and nothing switches it back off:

- ``QUANTREG_STRICT`` set to 1/true/yes/on in the environment;
- ``strict: true`` at the top of a user or run table, read from the table's header, so it is
  honoured even when that table's rules are rejected and whatever order the files were listed
  in (plugin and default tables cannot set the mode);
- vLLM's ``additional_config={"quantreg": {"strict": true}}`` for one run.

The CLI, ``register()`` and the seam all call :func:`decide_mode`, so they cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .tables import Layer, TableHeader

STRICT_ENV = "QUANTREG_STRICT"
TRUE_WORDS = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Mode:
    """The mode in force and every source that asked for strict (empty when lenient)."""

    strict: bool
    because: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"strict ({'; '.join(self.because)})" if self.strict else "lenient"


def env_strict(env: Mapping[str, str]) -> bool:
    return env.get(STRICT_ENV, "").strip().lower() in TRUE_WORDS


def decide_mode(env: Mapping[str, str], headers: Iterable[TableHeader], run_strict: bool | None = None) -> Mode:
    """Strict if the environment, a user/run table header or the run's settings ask for it."""
    because: list[str] = []
    if env_strict(env):
        because.append(f"{STRICT_ENV}={env[STRICT_ENV].strip()}")
    because += [f"strict: true in {h.path}" for h in headers if h.layer >= Layer.USER and h.strict is True]
    if run_strict:
        because.append('vLLM additional_config {"quantreg": {"strict": true}}')
    return Mode(bool(because), tuple(because))
