"""Interleaved timing rounds until a deadline: the one loop both of tune's measurements time with.

Why one loop: the noise rule of :mod:`quantreg.tune.rank` compares methods round by round (paired
rounds), so every measurement must time the same way: round 0 warms up and is discarded; each
round times every live method at every token count, the method order rotated by one per round so
no method always runs right after another; the timed span is the forward alone and its output is
checked outside it (every timed output, issue 32 item 5); a method whose forward raises or whose
output is wrong is refused at once, with the token count, and not timed again; rounds go on while
another one like the last would end before the deadline, :data:`MIN_ROUNDS` measured rounds at least.
The MoE measurement (:mod:`.measure`) and the dense one (:mod:`.dense_measure`) each say only how
to run one timed forward.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from .rank import MIN_PAIRED_ROUNDS, Result, median, sanity

MAX_ROUNDS = 25
"""Measured rounds at most: beyond this the interval no longer narrows enough to change a verdict."""
MIN_ROUNDS = MIN_PAIRED_ROUNDS + 2
"""Measured rounds even when the budget is spent: fewer leave too wide an interval to judge noise by
(a tiny layer's round takes ~0.2 s, a 20B-shaped one a few seconds)."""
Progress = Callable[..., None]
"""``progress(step text, fraction done 0..1, detail=False)``; ``detail`` steps (one method at one
token count) are shown on a terminal only."""
TimedForward = Callable[[str, int], tuple[float, "str | None"]]
"""``(method, tokens) -> (elapsed ms of the forward alone, why its output is wrong or None)``."""


@contextlib.contextmanager
def ctrl_c_latched() -> Iterator[Callable[[], None]]:
    """Ctrl-C raises ``KeyboardInterrupt`` as always, and is also latched; the check it yields raises
    it again. Why: Python raises a signal's exception at whatever bytecode runs next, and where that
    is a finalizer (``__del__``, a weakref callback run by the collector among torch's and vLLM's
    objects), Python prints "Exception ignored" and goes on -- tune then ran every round after a
    Ctrl-C and exited 0 (a flake on a loaded host: the slower the rounds, the more finalizers run
    while the signal is pending). The loop below calls the check after every timed forward, so a
    swallowed Ctrl-C stops tune at the next one. Outside the main thread, or where someone else's
    SIGINT handler is installed, nothing changes."""
    def unchanged() -> None:
        return None

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield unchanged
        return
    hit: list[int] = []

    def latch(signum: int, frame: Any) -> None:
        hit.append(signum)
        raise KeyboardInterrupt

    def check() -> None:
        if hit:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, latch)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def timing_rounds(label: str, names: Sequence[str], tokens: Sequence[int], live: Mapping[str, Any],
                  results: Mapping[str, Result], timed: TimedForward, refuse: Callable[[str, str], None],
                  deadline: float, progress: Progress) -> int:
    """:func:`_timing_rounds` with Ctrl-C latched (:func:`ctrl_c_latched`)."""
    with ctrl_c_latched() as interrupted:
        return _timing_rounds(label, names, tokens, live, results, timed, refuse, deadline, progress, interrupted)


def _timing_rounds(label: str, names: Sequence[str], tokens: Sequence[int], live: Mapping[str, Any],
                   results: Mapping[str, Result], timed: TimedForward, refuse: Callable[[str, str], None],
                   deadline: float, progress: Progress, interrupted: Callable[[], None]) -> int:
    """Time every method of ``names`` still in ``live`` at every count of ``tokens`` until ``deadline``.

    ``timed`` runs one forward; ``refuse(name, why)`` takes a method out (it must drop it from
    ``live``). Samples go to ``results[name].samples``; at the end each passing result gets its
    medians (``ms``) and its :func:`~quantreg.tune.rank.sanity` warnings, each said through
    ``progress``. Returns the measured rounds.
    """
    rounds, round_s = 0, 0.0
    for round_no in range(MAX_ROUNDS + 1):  # round 0 warms up and is discarded
        began = time.monotonic()
        order = list(names[round_no % len(names):]) + list(names[:round_no % len(names)])
        for t in tokens:
            for name in [n for n in order if n in live]:
                left = max(deadline - time.monotonic(), round_s * max(MIN_ROUNDS - round_no + 1, 0))
                progress(f"{label}: {'warm-up' if not round_no else f'round {round_no}'}: {name} at "
                         f"{_tok(t)}, about {left:.0f}s left", min(1.0, round_no / MAX_ROUNDS), detail=True)
                elapsed, error = timed(name, t)
                interrupted()  # a Ctrl-C a finalizer swallowed during that forward stops tune here
                if error is not None:
                    refuse(name, f"forward at {_tok(t)} (timing): {error}")
                elif round_no:
                    results[name].samples.setdefault(t, []).append(elapsed)
        if not live:
            break
        rounds = round_no
        round_s = time.monotonic() - began
        if round_no:
            progress(f"{label}: timing round {round_no} took {round_s:.1f}s", min(1.0, round_no / MAX_ROUNDS))
        # stop when another round like this one (plus half of one for tearing the layers down)
        # would end past the deadline; MIN_ROUNDS measured rounds at least
        if round_no >= MIN_ROUNDS and time.monotonic() + 1.5 * round_s > deadline:
            break
    for name in names:
        result = results[name]
        if result.ok:
            result.ms = {t: median(result.samples[t]) for t in tokens if result.samples.get(t)}
            result.warnings = sanity(result)
            for warning in result.warnings:
                progress(f"{label}: WARNING {name}: {warning}", 1.0)
    return rounds


def _tok(t: int) -> str:
    return f"{t} token{'s' if t != 1 else ''}"
