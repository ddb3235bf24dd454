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

import logging
import os

from .. import settings
from ..problems import QuantregError

logger = logging.getLogger("vllm.quantreg")


class PublishedFingerprint:
    """One environment variable holding the first process's fingerprint of ``what``."""

    def __init__(self, env_var: str, what: str, first: str, cause: str) -> None:
        self.env_var = env_var
        self.what = what  # "effective table"
        self.first = first  # "its parent process"
        self.cause = cause  # "a table file or plugin changed"
        self.published: str | None = None

    def check(self, fingerprint: str, strict: bool) -> None:
        """Publish ``fingerprint`` if nobody has; else compare: a mismatch warns, or raises when strict."""
        parent = settings.raw(self.env_var)
        if not parent:
            os.environ[self.env_var] = self.published = fingerprint
            return
        if parent == fingerprint:
            return
        message = (f"quantreg: this process (pid {os.getpid()}) loaded a different {self.what} (fingerprint "
                   f"{fingerprint}) than {self.first} ({parent}): {self.cause} between process starts, so "
                   "processes may decide differently")
        if strict:
            raise QuantregError(message)
        logger.warning(message)

    def withdraw(self) -> None:
        """Undo this process's publication (tests, ``unregister()``)."""
        if self.published is not None and settings.raw(self.env_var) == self.published:
            del os.environ[self.env_var]
        self.published = None
