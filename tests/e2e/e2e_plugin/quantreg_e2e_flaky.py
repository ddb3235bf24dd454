"""A throwaway plugin whose table hook fails in one kind of process only (class 6 of issue 21).

Why: a plugin hook can depend on something that differs between vLLM's processes (a device
initialised only in the Worker, a file readable only by the driver). Such a process drops exactly
that piece (one WARNING) and then decides differently from the others; the fingerprint check must
notice it. ``E2E_FLAKY_TABLE`` names the table the hook registers; the hook raises in every
process whose multiprocessing name starts with ``E2E_FLAKY_FAILS_IN`` (``EngineCore``,
``MainProcess``) and ``E2E_FLAKY_HOOKS`` names (``register_tables`` by default; its
``register_quant_config_keepers`` registers nothing, so its failure leaves no rule behind).
Installed as a real distribution (entry point ``flaky``) by the tests.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable

import quantreg

TABLE_ENV = "E2E_FLAKY_TABLE"
FAILS_IN_ENV = "E2E_FLAKY_FAILS_IN"


HOOKS_ENV = "E2E_FLAKY_HOOKS"
"""Which hooks fail there (comma-separated; default ``register_tables``)."""


def _fails(hook: str) -> str | None:
    fails_in = os.environ.get(FAILS_IN_ENV, "")
    process = multiprocessing.current_process().name
    hooks = os.environ.get(HOOKS_ENV, "register_tables").split(",")
    return process if fails_in and process.startswith(fails_in) and hook in hooks else None


@quantreg.hookimpl
def register_tables(register: Callable[[str | os.PathLike[str]], None]) -> None:
    process = _fails("register_tables")
    if process is not None:
        raise RuntimeError(f"e2e flaky: no table in process {process}")
    if os.environ.get(TABLE_ENV):
        register(os.environ[TABLE_ENV])


@quantreg.hookimpl
def register_quant_config_keepers(register: Callable[[object], None]) -> None:
    """Registers nothing; fails where told: a dropped piece that leaves no rule behind."""
    process = _fails("register_quant_config_keepers")
    if process is not None:
        raise RuntimeError(f"e2e flaky: no keepers in process {process}")
