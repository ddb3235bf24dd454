"""A throwaway plugin of misbehaving methods for ``quantreg tune``'s containment (issue 21, classes 3, 4, 7).

Each is ``mxfp4_reference`` with one fault: its constructor raises ``SystemExit``; its forward
returns ``None``, or a wrongly shaped tensor (one row: broadcasting would compare it with every
reference row), or raises at 64 tokens and more, or is right at 1 and 5 tokens and wrong at 64 and
more (the float64 check runs at every count tune times), or returns NaN once it is being timed
(every timed output is checked finite), or raises with terminal escapes and a newline in its
message; ``tune_chatty`` is correct but prints to stdout on every forward (``--json`` must keep
stdout for its object). Two more have a probe that hangs or raises ``SystemExit``. Tune must refuse
each faulty one with a reason, rank the chatty one, and finish with a table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from quantreg_hpu_mxfp4.method import Mxfp4ReferenceMoEMethod

import quantreg

#: (name, class, what it does), in this module.
FAULTS = {
    "tune_exit_build": "raises SystemExit(0) when constructed",
    "tune_none": "returns None from its forward",
    "tune_one_row": "returns one row whatever the token count",
    "tune_big_only": "raises at 64 tokens and more",
    "tune_wrong_big": "right at 1 and 5 tokens, 1.5x off at 64 and more",
    "tune_nan_late": "right for its first 4 forwards (the float64 check), NaN from then on (timing)",
    "tune_escape": "raises with an escape sequence and a newline in its message",
    "tune_chatty": "correct, prints to stdout on every forward",
}
#: Methods whose availability probe misbehaves (tune asks every method's probe first).
PROBES = {"tune_probe_hangs": "probe_hangs", "tune_probe_exits": "probe_exits"}


@quantreg.hookimpl
def register_methods(register: Callable[[quantreg.Method], None]) -> None:
    for name, what in FAULTS.items():
        cls = "".join(part.title() for part in name.split("_")[1:]) + "Method"
        register(quantreg.Method(name=name, target=f"quantreg_tune_misbehaving:{cls}", requires=("torch", "vllm"),
                                 description=what))
    for name, probe in PROBES.items():
        register(quantreg.Method(name=name, target="quantreg_tune_misbehaving:ChattyMethod", requires=("torch", "vllm"),
                                 probe=f"quantreg_tune_misbehaving:{probe}", description=f"its probe: {probe}"))


def probe_hangs() -> tuple[bool, str]:
    import time

    time.sleep(3600)
    return True, "never reached"


def probe_exits() -> tuple[bool, str]:
    raise SystemExit(0)


class _Faulty(Mxfp4ReferenceMoEMethod):  # type: ignore[misc]
    def fault(self, out: Any) -> Any:
        return out

    def apply_monolithic(self, *args: Any, **kwargs: Any) -> Any:
        return self.fault(super().apply_monolithic(*args, **kwargs))

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        return self.fault(super().apply(*args, **kwargs))


class ExitBuildMethod(_Faulty):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise SystemExit(0)


class NoneMethod(_Faulty):
    def fault(self, out: Any) -> Any:
        return None


class OneRowMethod(_Faulty):
    def fault(self, out: Any) -> Any:
        return out[:1]


class BigOnlyMethod(_Faulty):
    def fault(self, out: Any) -> Any:
        if out.shape[0] >= 64:
            raise RuntimeError("tune_big_only: no kernel for 64 tokens or more")
        return out


class WrongBigMethod(_Faulty):
    def fault(self, out: Any) -> Any:
        return out * 1.5 if out.shape[0] >= 64 else out


class NanLateMethod(_Faulty):
    calls = 0

    def fault(self, out: Any) -> Any:
        NanLateMethod.calls += 1
        return out if NanLateMethod.calls <= 4 else out * float("nan")


class EscapeMethod(_Faulty):
    def fault(self, out: Any) -> Any:
        raise ValueError("\x1b[2J\x1b[31mcleared\nquantreg tune: forged line")


class ChattyMethod(_Faulty):
    def fault(self, out: Any) -> Any:
        print("chatty: a line on stdout")
        return out
