"""A throwaway third-party plugin used by the end-to-end tests, installed as a real
distribution (a ``*.dist-info`` with ``entry_points.txt`` on ``PYTHONPATH``) so that every vLLM
process (driver, EngineCore, Worker) discovers it through the ``quantreg`` entry-point group.

``e2e_unquantized`` is vLLM's own unquantized MoE method under another class name, so a test can
see a table change the class a Worker builds while the numbers stay vLLM's. ``e2e_never`` is
never available, to exercise fallback chains; ``e2e_broken`` raises when vLLM builds a layer.
"""

from __future__ import annotations

from collections.abc import Callable

import quantreg


@quantreg.hookimpl
def register_methods(register: Callable[[quantreg.Method], None]) -> None:
    register(quantreg.Method(name="e2e_unquantized", target="quantreg_e2e_methods:E2EUnquantizedMethod",
                             devices=("cpu",), options=("tag",)))
    register(quantreg.Method(name="e2e_broken", target="quantreg_e2e_methods:E2EBrokenMethod", devices=("cpu",)))
    register(quantreg.Method(name="e2e_never", target="quantreg_e2e_methods:E2EUnquantizedMethod",
                             probe="quantreg_e2e_plugin:never"))


def never() -> tuple[bool, str]:
    return False, "e2e probe: this method is never available"
