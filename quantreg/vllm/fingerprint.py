"""A fingerprint the first vLLM process publishes in the environment for later processes to compare.

Why: every vLLM process (driver, EngineCore, each Worker) builds its own registry, and nothing
else makes them agree. The first one to register writes its fingerprint into ``os.environ``,
which vLLM's child processes inherit; a later process that built a different registry (a table
edited between process starts, a plugin upgraded) warns, or fails in strict mode. Two things are
published this way, the table stack of the environment (``QUANTREG_FINGERPRINT``) and the stack
with the run's ``additional_config`` tables (``QUANTREG_RUN_FINGERPRINT``), so the logic lives
here once.
"""

from __future__ import annotations

import os

from .. import settings
from ..problems import printable, quantreg_logger, strict_error

logger = quantreg_logger("vllm.quantreg")


class PublishedFingerprint:
    """One environment variable holding the first process's fingerprint of ``what``."""

    def __init__(self, env_var: str, what: str, first: str, cause: str) -> None:
        self.env_var = env_var
        self.what = what  # "effective table"
        self.first = first  # "its parent process"
        self.cause = cause  # "a table file or plugin changed"
        self.published: str | None = None

    def check(self, fingerprint: str, strict: bool, role: str = "", left_out: int = 0) -> None:
        """Publish ``fingerprint`` if nobody has; else compare: a mismatch warns, or raises when strict.

        ``role`` names this process as vLLM's log prefix does (``EngineCore``, ``Worker_TP1``), so
        the one line says *which* process decides differently. ``left_out``: how many faults this
        process dropped (a plugin hook that failed only here, a shipped table whose text did not
        match its sha256): then the likely cause is those, said in the warnings before this one.
        """
        parent = settings.raw(self.env_var)
        if not parent:
            os.environ[self.env_var] = self.published = fingerprint
            return
        if parent == fingerprint:
            return
        who = f"{printable(role)}, pid {os.getpid()}" if role else f"pid {os.getpid()}"
        cause = (f"it left out {left_out} piece(s) that failed here (the WARNINGs above), or {self.cause} between "
                 "process starts" if left_out else f"{self.cause} between process starts")
        message = (f"quantreg: this process ({who}) loaded a different {self.what} (fingerprint {fingerprint}) "
                   f"than {self.first} ({printable(parent)[:80]}): {cause}, so processes may decide differently")
        if strict:
            raise strict_error(message)
        logger.warning("%s", message)

    def withdraw(self) -> None:
        """Undo this process's publication (tests, ``unregister()``)."""
        if self.published is not None and settings.raw(self.env_var) == self.published:
            del os.environ[self.env_var]
        self.published = None
