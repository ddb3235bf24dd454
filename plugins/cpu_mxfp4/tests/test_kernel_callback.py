"""The prefill path's callback into torch (``quantreg_cpu_mxfp4.callback``): Ctrl-C and SIGTERM reach
the caller, the real handlers are back after every forward, and a callback that does not report
its rows written stops the forward. Both ISA paths (the ``isa`` fixture, conftest.py)."""

from __future__ import annotations

import pytest
import torch
from cpu_mxfp4_kernel_support import pack, routing
from quantreg_cpu_mxfp4 import callback, kernel

from quantreg.models.gpt_oss_moe import random_gpt_oss_mxfp4_experts, random_hidden_states


def _prefill_case() -> tuple[object, ...]:
    """A forward on the prefill path (every expert pinned to the GEMM callback): the args and kwargs."""
    ex = random_gpt_oss_mxfp4_experts(4, 256, 256, bias=True, seed=31)
    ids, weights = routing(256, 4, 2, seed=33)
    w13, w2 = pack(ex)
    return random_hidden_states(256, 256, seed=32), ids, weights, w13, ex.w13_bias, w2, ex.w2_bias


def test_ctrl_c_during_the_prefill_callback_reaches_the_caller(isa: str) -> None:
    """SIGINT sent over and over while prefill forwards run: every forward in which the handler raised
    ``KeyboardInterrupt`` ends in one for the caller; none is lost in ctypes ("Exception ignored on
    calling ctypes callback function"), none is swallowed by a forward that returns, none turns into
    a failed forward. Before the fix >90 % of them were lost (``quantreg tune`` ignored Ctrl-C under
    load: its cpu_mxfp4 forward failed and was refused instead).

    Two signals landing in one forward give the caller one ``KeyboardInterrupt`` (as CPython gives one
    for two pending signals), so forwards are counted, not signals. The cyclic garbage collector is
    off for the loop: a finaliser of another test's garbage running inside a forward would lose a
    ``KeyboardInterrupt`` there (any Python ``__del__`` does), which is not this kernel's doing (seen
    once in the whole suite under load, 1 in 575)."""
    import gc
    import os
    import signal
    import sys
    import threading
    import time

    args = _prefill_case()
    lost: list[str] = []
    state = {"armed": False, "raised": 0, "interrupted": 0, "caught": 0, "swallowed": 0}

    def handler(_signum: int, _frame: object) -> None:
        if state["armed"]:  # only inside moe_forward: outside it the loop's own code must not be interrupted
            state["raised"] += 1
            raise KeyboardInterrupt

    def sender() -> None:
        while not stop.is_set():
            time.sleep(0.002 + 0.008 * (time.monotonic() % 1.0))
            os.kill(os.getpid(), signal.SIGINT)

    def unraisable(u: object) -> None:
        where = getattr(u, "object", None)
        lost.append(f"{getattr(u, 'err_msg', None)}: {getattr(u, 'exc_value', None)!r} in {where!r}")

    failures: list[str] = []
    gc.collect()
    gc.disable()
    before, hook = signal.signal(signal.SIGINT, handler), sys.unraisablehook
    sys.unraisablehook = unraisable
    stop = threading.Event()
    thread = threading.Thread(target=sender, daemon=True)
    try:
        thread.start()
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            raised = state["raised"]
            try:
                state["armed"] = True
                kernel.moe_forward(*args, gemm_min_tokens=1)  # type: ignore[arg-type]
                state["armed"] = False
                if state["raised"] > raised:
                    state["interrupted"] += 1
                    state["swallowed"] += 1
            except KeyboardInterrupt:
                state["armed"] = False
                state["interrupted"] += 1
                state["caught"] += 1
            except RuntimeError as exc:
                state["armed"] = False
                failures.append(str(exc))
        stop.set()
        thread.join()
    finally:
        stop.set()
        signal.signal(signal.SIGINT, before)
        sys.unraisablehook = hook
        gc.enable()
    assert state["interrupted"] >= 5, state  # the signals did land in forwards
    assert (lost, failures) == ([], []), (state, lost[:3], failures[:3])
    assert state["swallowed"] == 0 and state["caught"] == state["interrupted"], state


def test_the_handlers_are_back_after_a_forward_and_a_forward_runs_off_the_main_thread(
        isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The held handlers (SIGINT and SIGTERM with Python handlers) are the caller's again after a
    prefill forward, whether it returned or raised; a forward in another thread holds nothing
    (Python runs handlers only in the main thread; ``signal.signal`` there would raise)."""
    import signal
    import threading

    args = _prefill_case()

    def on_term(_signum: int, _frame: object) -> None:
        raise SystemExit(143)

    before = {sig: signal.getsignal(sig) for sig in kernel.HELD_SIGNALS}
    signal.signal(signal.SIGTERM, on_term)
    try:
        kernel.moe_forward(*args, gemm_min_tokens=1)  # type: ignore[arg-type]
        assert signal.getsignal(signal.SIGTERM) is on_term
        assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
        with monkeypatch.context() as patch:  # the callback raises: the forward raises it, handlers still back
            patch.setattr(callback, "_wrap", lambda *_: (_ for _ in ()).throw(MemoryError("no room for the tile")))
            with pytest.raises(MemoryError, match="no room for the tile"):
                kernel.moe_forward(*args, gemm_min_tokens=1)  # type: ignore[arg-type]
        assert signal.getsignal(signal.SIGTERM) is on_term and signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
        out: list[object] = []
        thread = threading.Thread(target=lambda: out.append(kernel.moe_forward(*args, gemm_min_tokens=1)))  # type: ignore[arg-type]
        thread.start()
        thread.join()
        assert len(out) == 1 and isinstance(out[0], torch.Tensor) and out[0].shape == args[0].shape  # type: ignore[attr-defined]
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_callback_that_does_not_report_its_rows_written_stops_the_forward(
        isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only :data:`kernel.GEMM_DONE` counts as done: a callback that returns anything else -- as the
    return slot ctypes leaves when an exception escapes the callback at entry -- fails the forward
    rather than passing rows it never wrote."""
    real = kernel._Gemm.__call__

    def says_zero(self: kernel._Gemm, *a: int) -> int:
        real(self, *a)
        return 0  # the old "success", now just a value that is not GEMM_DONE

    monkeypatch.setattr(kernel._Gemm, "__call__", says_zero)
    with pytest.raises(RuntimeError, match="did not report its rows written"):
        kernel.moe_forward(*_prefill_case(), gemm_min_tokens=1)  # type: ignore[arg-type]
