"""Entry point ``crossing`` of the crossover test plugin: registers ("tune_decode", "tune_prefill")."""

from __future__ import annotations

from collections.abc import Callable

from quantreg_tune_crossover import register as register_curves

import quantreg


@quantreg.hookimpl
def register_methods(register: Callable[[quantreg.Method], None]) -> None:
    register_curves(("tune_decode", "tune_prefill"), register)
