"""The one timing loop of ``quantreg tune`` (quantreg/tune/rounds.py), driven by a forward we control.

Both measurements (the experts on vLLM's MoE layer, the dense kinds on vLLM's linear layers) time
through it, so what the ranking's noise rule relies on is checked here once: warm-up discarded,
the method order rotated, a failing method refused with its token count and never timed again,
at least MIN_ROUNDS rounds whatever the deadline, no more than MAX_ROUNDS, and medians at the end.
"""

from __future__ import annotations

import time

from quantreg.tune.rank import Result
from quantreg.tune.rounds import MAX_ROUNDS, MIN_ROUNDS, timing_rounds


def run(names: list[str], tokens: list[int], deadline: float, fail_at: tuple[str, int, int] | None = None
        ) -> tuple[int, dict[str, Result], list[tuple[str, int]], list[str], dict[str, str]]:
    """timing_rounds over fake methods whose forward takes ``t`` ms (recorded, not slept)."""
    live = {n: object() for n in names}
    results = {n: Result(n, ok=True) for n in names}
    calls: list[tuple[str, int]] = []
    said: list[str] = []
    refused: dict[str, str] = {}

    def timed(name: str, t: int) -> tuple[float, str | None]:
        calls.append((name, t))
        if fail_at is not None and (name, t) == fail_at[:2] and len([c for c in calls if c == (name, t)]) > fail_at[2]:
            return 0.1, "returned 3 non-finite values (NaN or inf) of 8"
        return float(t) + (0.5 if name == "b" else 0.0), None

    def refuse(name: str, why: str) -> None:
        refused[name] = why
        results[name].ok = False
        live.pop(name)

    rounds = timing_rounds("key", names, tokens, live, results, timed, refuse, deadline,
                           lambda text, frac, detail=False: said.append(text))
    return rounds, results, calls, said, refused


def test_a_spent_deadline_still_measures_min_rounds_after_the_warm_up() -> None:
    rounds, results, calls, said, _ = run(["a", "b"], [1, 64], deadline=time.monotonic() - 1)
    assert rounds == MIN_ROUNDS
    assert len(calls) == (MIN_ROUNDS + 1) * 2 * 2  # the warm-up round too, not kept
    assert all(len(results[n].samples[t]) == MIN_ROUNDS for n in "ab" for t in (1, 64))
    assert results["a"].ms == {1: 1.0, 64: 64.0} and results["b"].ms == {1: 1.5, 64: 64.5}
    assert any("warm-up: a at 1 token," in s for s in said) and any("about" in s and "s left" in s for s in said)


def test_the_order_rotates_each_round_so_no_method_always_goes_first() -> None:
    _, _, calls, _, _ = run(["a", "b", "c"], [1], deadline=time.monotonic() - 1)
    firsts = [calls[i][0] for i in range(0, len(calls), 3)]
    assert firsts[:4] == ["a", "b", "c", "a"], firsts


def test_a_time_left_runs_up_to_max_rounds() -> None:
    rounds, results, _, _, _ = run(["a"], [1], deadline=time.monotonic() + 60)
    assert rounds == MAX_ROUNDS and len(results["a"].samples[1]) == MAX_ROUNDS


def test_a_method_wrong_mid_timing_is_refused_with_the_count_and_not_timed_again() -> None:
    rounds, results, calls, _, refused = run(["a", "b"], [1, 64], deadline=time.monotonic() - 1,
                                             fail_at=("b", 64, 2))
    assert refused == {"b": "forward at 64 tokens (timing): returned 3 non-finite values (NaN or inf) of 8"}
    assert calls.count(("b", 64)) == 3 and calls.count(("b", 1)) == 3  # never asked again after the refusal
    assert not results["b"].ok and results["b"].ms == {}  # a refused method keeps no medians
    assert rounds == MIN_ROUNDS and results["a"].ms == {1: 1.0, 64: 64.0}


def test_when_every_method_is_refused_the_loop_ends() -> None:
    rounds, _, calls, _, refused = run(["b"], [64], deadline=time.monotonic() + 60, fail_at=("b", 64, 0))
    assert set(refused) == {"b"} and calls == [("b", 64)] and rounds == 0


class _SignalInFinalizer:
    """An object whose finalizer is where a real SIGINT lands: Python raises KeyboardInterrupt inside
    ``__del__``, prints "Exception ignored" and carries on (what a collector run among torch's and
    vLLM's objects does to a Ctrl-C that arrives at the wrong bytecode)."""

    def __del__(self) -> None:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs at one of these bytecodes, inside the finalizer
            pass


def test_a_ctrl_c_swallowed_by_a_finalizer_still_stops_the_rounds() -> None:
    """The flake of issue 53 (tune ran every round after SIGINT and exited 0), by its mechanism: a real
    SIGINT whose KeyboardInterrupt is raised in a finalizer. The latch stops the loop at the next forward."""
    import pytest

    forwards: list[int] = []

    def timed(name: str, t: int) -> tuple[float, str | None]:
        forwards.append(t)
        if len(forwards) == 3:
            _SignalInFinalizer()  # dropped at once: its __del__ runs here and swallows the KeyboardInterrupt
        return 1.0, None

    with pytest.raises(KeyboardInterrupt):
        timing_rounds("key", ["a"], [1], {"a": object()}, {"a": Result("a", ok=True)}, timed, lambda n, w: None,
                      time.monotonic() + 60, lambda *a, **k: None)
    assert len(forwards) == 3  # stopped right after the forward in which the Ctrl-C was swallowed
    import signal

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back
