"""A third-party plugin whose methods do what no compiler can trace, for vLLM's default mode (issue 43).

``recorded_small`` and ``recorded_large`` compute like plugin #1's ``mxfp4_reference`` and, on
every forward, append one line ``NAME TOKENS PID`` to the file named by ``QUANTREG_E2E_RECORD``
(a file write: a side effect Dynamo refuses). A ``tokens:`` split of the two, served by vLLM in its
default (compiled) mode, shows in that file which side served each forward and at what size: proof
that the split is decided per forward inside quantreg's op, not baked into the one trace.
"""

from __future__ import annotations

from collections.abc import Callable

import quantreg


@quantreg.hookimpl
def register_methods(register: Callable[[quantreg.Method], None]) -> None:
    for name in ("recorded_small", "recorded_large"):
        register(quantreg.Method(name=name, target=f"quantreg_e2e_recorded:{_CLASSES[name]}", devices=("cpu",)))


_CLASSES = {"recorded_small": "RecordedSmall", "recorded_large": "RecordedLarge"}
