"""The process settings a conformance run changes while it runs, and puts back afterwards.

vLLM logs INFO to stdout and torch spins OpenMP workers; neither suits a run whose stdout is a
table (or JSON) and whose layers are tiny. Both tweaks are scoped, because the caller may be a
long-lived pytest session or a CLI that starts subprocesses afterwards.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_vllm() -> Iterator[None]:
    """stdout to stderr and ``VLLM_LOGGING_LEVEL=WARNING`` (unless set) while the checks run.

    The variable is put back afterwards: it is read when vLLM is first imported, and leaving it
    set would silence vLLM's INFO log in every subprocess this process starts later. vLLM's log
    handler keeps the stream it found at import, hence ``sys.__stderr__`` (never closed) rather
    than whatever ``sys.stderr`` is at the moment.
    """
    saved = os.environ.get("VLLM_LOGGING_LEVEL")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        with contextlib.redirect_stdout(sys.__stderr__ or sys.stderr):
            yield
    finally:
        if saved is None:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)
        else:
            os.environ["VLLM_LOGGING_LEVEL"] = saved


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread while the checks run (restored after).

    The layers are tiny, so threads buy nothing, and on a busy CI machine OpenMP's spinning
    workers made the same run 10-70x slower (measured: 17.6 s vs 0.24 s for forward-bias on two
    loaded cores). Only torch's own setting is touched (the checks import torch anyway).
    """
    try:
        torch = importlib.import_module("torch")
    except Exception:  # no torch: the checks that need it report that themselves
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
