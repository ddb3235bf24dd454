"""Strict or lenient: the one decision of how faults are treated, made in one place.

Strict mode makes every fault fatal at vLLM start-up; lenient logs it and carries on without the
faulty file or plugin. Any one of these asks for strict, and nothing switches it back off:

- ``QUANTREG_STRICT`` set to 1/true/yes/on (any case) in the environment; 0/false/no/off or
  empty is lenient, and any other value is a problem (``environment: QUANTREG_STRICT: ...``)
  that counts as strict, so a misspelt value fails loudly instead of silently losing strict;
- ``strict: true`` at the top of a user or run table, read from the table's header, so it is
  honoured even when that table's rules are rejected and whatever order the files were listed
  in (plugin and default tables cannot set the mode); when the file's YAML cannot be read at
  all, a top-level ``strict: true`` line in its raw text still counts
  (:func:`quantreg.table.file.raw_strict`);
- vLLM's ``additional_config={"quantreg": {"strict": true}}`` for one run.

The CLI, ``register()`` and the seam all call :func:`decide_mode`, so they cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from . import settings
from .problems import Problem, printable
from .table.file import TableHeader, Tier


@dataclass(frozen=True)
class Mode:
    """The mode in force and every source that asked for strict (empty when lenient)."""

    strict: bool
    because: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"strict ({'; '.join(self.because)})" if self.strict else "lenient"


def env_strict(env: Mapping[str, str]) -> bool:
    """Does ``QUANTREG_STRICT`` ask for strict? Anything but a false word does (see the module doc)."""
    return bool(settings.value(settings.STRICT, env))


def strict_problem(env: Mapping[str, str]) -> Problem | None:
    """A problem for a ``QUANTREG_STRICT`` value that is neither a true nor a false word."""
    message = settings.parsed(settings.STRICT, env)[1]
    return None if message is None else Problem(settings.ENVIRONMENT, None, settings.STRICT, message)


def decide_mode(env: Mapping[str, str], headers: Iterable[TableHeader], run_strict: bool | None = None,
                shipped_strict: bool = False) -> Mode:
    """Strict if the environment, a user/run table header, the run's settings or the driver that
    shipped this worker its tables (``shipped_strict``, :func:`quantreg.vllm.multinode.published_strict`)
    ask for it. The one place strictness is decided: callers pass what they know, never OR it in."""
    because: list[str] = []
    if env_strict(env):
        because.append(f"{settings.STRICT}={printable((settings.raw(settings.STRICT, env) or '').strip()[:40])}")
    because += [f"strict: true in {h.path}" for h in headers if h.tier >= Tier.USER and h.strict is True]
    if run_strict:
        because.append('vLLM additional_config {"quantreg": {"strict": true}}')
    if shipped_strict:
        because.append("the driver that shipped this process its tables was strict")
    return Mode(bool(because), tuple(because))
