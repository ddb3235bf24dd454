"""The prefill path's matmul, called back from the C library into torch (:class:`_Gemm`), and the
holding of Python's signal handlers while C may call it (:func:`_signals_held`, so Ctrl-C is never lost).
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import threading
from collections.abc import Iterator
from typing import Any

import torch

GEMM_DONE = 0x51524F4B
"""What the prefill callback returns once it has written its rows (``csrc/moe.cpp``'s ``kQrGemmDone``):
any other value stops the forward, so a callback that never ran its body (below) cannot pass."""
HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""Signals whose Python handlers wait while the C forward may call back into Python (:func:`_signals_held`)."""
_GEMM_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                            ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32)
_GEMM_DTYPES = {0: torch.float32, 1: torch.bfloat16}  # csrc/moe.cpp's QR_F32 / QR_BF16


def _wrap(address: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``count`` elements of C-owned memory at ``address`` (no copy)."""
    size = count * dtype.itemsize
    return torch.frombuffer((ctypes.c_char * size).from_address(address), dtype=dtype, count=count)


class _Gemm:
    """The prefill path's matmul, called back by the C library: ``c[:m, :n] = a @ b``.

    ``a`` ``[m, k]`` (the expert's tokens), ``b`` ``[k, n]`` (the K-major weight tile), both fp32 or
    both bf16 (``dtype``; bf16 where the CPU has AVX-512 BF16, as ``csrc/moe.cpp`` decides); the
    result goes to the fp32 rows ``c`` (row stride ``ldc``). An exception cannot cross the C
    frames: it is kept, the callback returns 1 (the C side stops), and :func:`.kernel._forward` raises it.
    One raised as the callback is entered, before its ``try`` (a signal handler's
    ``KeyboardInterrupt`` runs at a function's first instruction), would be printed and swallowed
    by ctypes: :func:`.kernel._forward` holds the handlers of :data:`HELD_SIGNALS` while the C call runs,
    and the C side takes only :data:`GEMM_DONE` as success, never an uninitialised return slot.
    """

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.fn = _GEMM_FN(self)

    def __call__(self, a: int, m: int, k: int, b: int, n: int, c: int, ldc: int, dtype: int) -> int:
        try:
            kind = _GEMM_DTYPES[dtype]
            lhs = _wrap(a, m * k, kind).view(m, k)
            rhs = _wrap(b, k * n, kind).view(k, n)
            out = _wrap(c, (m - 1) * ldc + n, torch.float32).as_strided((m, n), (ldc, 1))
            if kind == torch.float32 and ldc == n:
                torch.mm(lhs, rhs, out=out)
            else:
                out.copy_(torch.mm(lhs, rhs))
            return GEMM_DONE
        except BaseException as exc:  # handed back to the caller, never lost
            self.error = exc
            return 1


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Python signal handlers (Ctrl-C's ``KeyboardInterrupt``, vLLM's SIGTERM shutdown) run after the block.

    Why: while the C forward runs, a signal only sets CPython's flag; the next Python code to run
    -- the prefill callback, from inside C -- would run the handler, and its exception would be lost
    in ctypes (the forward failing as "the gemm callback failed", Ctrl-C ignored: seen in
    ``quantreg tune`` under load). So for the block each Python handler of :data:`HELD_SIGNALS` is
    replaced by one that notes the signal, and a noted signal is raised again once the real
    handlers are back. Only the main thread runs Python handlers (elsewhere there is nothing to
    hold); ``SIG_DFL`` / ``SIG_IGN`` act in C and are left alone. Two ``sigaction`` calls per
    signal, on the prefill path only (a forward of milliseconds).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    held: dict[signal.Signals, Any] = {}
    try:  # set up inside the try: a handler that fires while the others are swapped is restored too
        for sig in HELD_SIGNALS:
            handler = signal.getsignal(sig)
            if callable(handler):
                held[sig] = handler
                signal.signal(sig, lambda signum, _frame: noted.append(signum))
        yield
    finally:
        caught: BaseException | None = None
        for sig, handler in held.items():
            restored = False
            while not restored:  # a handler restored a moment ago may raise here (Ctrl-C): the rest still are
                try:
                    signal.signal(sig, handler)
                    restored = True
                except BaseException as exc:  # before or after the call did its work: calling again is harmless
                    caught = caught or exc
        for signum in dict.fromkeys(noted):
            try:
                signal.raise_signal(signum)  # the real handler runs now, in the caller's frame
            except BaseException as exc:
                caught = caught or exc
        if caught is not None:
            raise caught
