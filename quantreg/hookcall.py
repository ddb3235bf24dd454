"""The one place quantreg calls plugin code, and the type check of what plugin code hands back.

Why one place: each feature used to bring its own ``try`` around a hook (keepers, findings,
limitations' ``applies``), so each relearnt the lessons: ``SystemExit`` in an ``applies`` check
ended ``explain --json`` with status 0 and no output, ``Finding(key=5)`` and
``VllmLimitation(device=None)`` were accepted and crashed the printer later, blocking checks
got no "still ..." warning. Now:

- :func:`call` runs any plugin callable (an import, a hook, an ``applies`` check, a keeper
  target, a probe) with the same containment: anything raised, ``SystemExit`` and other
  ``BaseException`` subclasses included, becomes ``(None, "Type: text")``; only
  ``KeyboardInterrupt`` passes. The "still ..." warning names the plugin (:func:`plugin_code`).
  With ``timeout`` the call runs in a daemon thread and is abandoned past it.
- :func:`value_problem` checks an item against the type a hook's ``register`` callback takes
  (:func:`quantreg.hookspecs.registered_type` reads it from the hookspec itself) *and* each of its
  dataclass fields against their annotations. So a new hook is contained and type-checked by
  being declared in :mod:`quantreg.hookspecs`.

Why at the bottom: this module imports nothing of quantreg but :mod:`quantreg.problems`, so every
module that runs plugin code (a method's probe, a limitation's ``applies``, the plugin loader)
calls down into it, and no value module has to import the plugin machinery to do so.

``os._exit`` and signals cannot be contained in-process (docs/operating.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import sys
import threading
import time
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

from .problems import describe, printable, quantreg_logger

logger = quantreg_logger("vllm.quantreg")

SLOW_SECONDS = 1.0
"""An import or hook call taking longer than this is logged (WARNING) while it runs and when it ends."""


class _Watchdog:
    """One daemon thread that logs ``still <doing>`` for every call into plugin code that runs past
    :data:`SLOW_SECONDS`, while it still runs.

    Why one thread and not a ``threading.Timer`` per call: ``register()`` makes a dozen such calls
    in every vLLM process, and each ``Thread.start()`` waits until the new thread has been scheduled,
    several milliseconds each on a loaded machine (issue 24.7, the start-up budget). The thread is
    started at the first call of a process (a forked child starts its own).
    """

    def __init__(self) -> None:
        self._reset()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._calls: dict[int, tuple[str, float, float]] = {}  # token -> (doing, due, seconds)
        self._count = 0
        self._thread: threading.Thread | None = None

    def begin(self, doing: str) -> int:
        seconds = SLOW_SECONDS
        with self._cond:
            self._count += 1
            self._calls[self._count] = (doing, time.monotonic() + seconds, seconds)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="quantreg-plugin-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
            return self._count

    def end(self, token: int) -> None:
        with self._cond:
            self._calls.pop(token, None)

    def _run(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while True:
                    now = time.monotonic()
                    due = [(t, call) for t, call in self._calls.items() if call[1] <= now]
                    if due:
                        for token, _ in due:  # once per call
                            del self._calls[token]
                        break
                    next_due = min((call[1] for call in self._calls.values()), default=None)
                    cond.wait(None if next_due is None else next_due - now)
            for _, (doing, _, seconds) in due:
                logger.warning("quantreg: still %s after %g s", doing, seconds)


_watchdog = _Watchdog()


@contextlib.contextmanager
def plugin_code(doing: str) -> Iterator[None]:
    """Around every call into plugin code: its stdout goes to stderr, and slowness is logged.

    ``doing`` names the call (``loading plugin 'x' (entry point x.mod)``). The watchdog thread
    logs ``still <doing>`` once the call has run :data:`SLOW_SECONDS`, so a plugin that blocks
    (a device runtime waiting for hardware) is named in the log while it blocks; a call that
    finished late is logged again with its duration.
    """
    start = time.monotonic()
    token = _watchdog.begin(doing)
    try:
        with contextlib.redirect_stdout(sys.stderr if sys.stderr is not None else io.StringIO()):
            yield
    finally:
        _watchdog.end(token)
        elapsed = time.monotonic() - start
        if elapsed > SLOW_SECONDS:
            logger.warning("quantreg: %s took %.1f s", doing, elapsed)



_NO_TIMEOUT = None
TIMED_OUT = "did not finish within"
"""How :func:`call`'s error for an abandoned call starts."""


def call(doing: str, fn: Callable[[], Any], timeout: float | None = _NO_TIMEOUT) -> tuple[Any, str | None]:
    """``(result, None)`` or ``(None, "X: text")``: nothing plugin code raises escapes but Ctrl-C.

    ``doing`` names the call and its plugin (``checking 'applies' of plugin 'x'``). ``timeout``
    (seconds) bounds it: past it the call is left running in a daemon thread and reported as
    ``"did not finish within N s"``, so one blocked plugin cannot block the process.
    """
    if timeout is None:
        try:
            with plugin_code(doing):
                return fn(), None
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit, GeneratorExit, custom BaseException subclasses: all plugin faults
            return None, describe(exc)
    box: list[tuple[Any, str | None]] = []

    def run() -> None:
        try:
            box.append((fn(), None))
        except BaseException as exc:  # in a thread even KeyboardInterrupt is the plugin's (it cannot reach us)
            box.append((None, describe(exc)))

    with plugin_code(doing):
        worker = threading.Thread(target=run, name=f"quantreg-plugin: {doing[:60]}", daemon=True)
        worker.start()
        worker.join(timeout)
    if not box:
        return None, f"{TIMED_OUT} {timeout:g} s (it keeps running in the background, unused)"
    return box[0]


def conforms(value: Any, hint: Any) -> bool:
    """Does ``value`` have the declared type ``hint``? (plain classes, unions, ``tuple[X, ...]``,
    ``Callable``, ``Any``; ``bool`` is not an ``int``; a NamedTuple's fields are checked too)."""
    if hint is Any or hint is object:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, h) for h in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(conforms(v, args[0]) for v in value)
        return len(args) == len(value) and all(conforms(v, a) for v, a in zip(value, args))
    if (origin is not None and getattr(origin, "__name__", "") == "Callable") or hint is Callable:
        return callable(value)
    if origin is not None:
        return isinstance(value, origin)
    if isinstance(hint, type):
        if hint is int and isinstance(value, bool):
            return False
        if not isinstance(value, hint):
            return False
        if issubclass(hint, tuple) and hasattr(hint, "_fields"):  # a NamedTuple such as Key
            fields = typing.get_type_hints(hint)
            return all(conforms(getattr(value, f), fields.get(f, Any)) for f in hint._fields)
        return True
    return True  # a hint this checker does not know: not refused


def _hint_text(hint: Any) -> str:
    """``a quantreg.Method`` / ``a quantreg.keepers.QuantConfigKeeper`` / ``a path``: the public name."""
    if isinstance(hint, type):  # every type a hook registers is exported by quantreg (tests/test_registered_fields.py)
        public = "quantreg" if hint.__module__.startswith("quantreg.") else hint.__module__
        return f"a {public}.{hint.__name__}"
    text = str(hint).replace("typing.", "").replace("collections.abc.", "")
    return HINT_WORDS.get(text, text)


#: How a message names a union a hookspec declares.
HINT_WORDS = {"str | os.PathLike[str]": "a path"}


#: Hooks whose items' fields a dedicated checker validates (and normalises: lists of devices become
#: tuples), with more precise messages than annotations give; only their type is checked here.
FIELDS_CHECKED_BY = {"register_methods": "quantreg.methods.check_method"}


def value_problem(item: Any, hint: Any, fields: bool = True) -> str | None:
    """Why ``item`` is not what a ``register`` declared with ``hint`` takes (``None`` if it is).

    ``fields``: also check each dataclass field of ``item`` against its annotation.
    """
    try:
        if not conforms(item, hint):
            return f"register() expects {_hint_text(hint)}, got {printable(type(item).__name__)}"
        if fields and dataclasses.is_dataclass(item) and not isinstance(item, type):
            hints = typing.get_type_hints(type(item))
            for f in dataclasses.fields(item):
                value = getattr(item, f.name)
                if f.name in hints and not conforms(value, hints[f.name]):
                    shown = printable(repr(value)[:60])
                    wanted = str(hints[f.name]).replace("typing.", "").replace("collections.abc.", "")
                    return (f"{type(item).__name__}.{f.name} must be {wanted}, got {shown} "
                            f"({printable(type(value).__name__)})")
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # an item whose attributes or repr raise is a fault, not a crash
        return f"the registered item cannot be inspected: {describe(exc)}"
    return None


T = typing.TypeVar("T")


def remade(cls: type[T], item: Any, plain: Callable[[Any], Any] = lambda v: v, **changes: Any) -> T:
    """A ``cls`` made from *every* init field of ``item`` (each passed through ``plain``), then ``changes``.

    Why: a registered value is kept as quantreg's own type (not a plugin's subclass, whose
    attributes could raise later) and stamped with the registering plugin. Copies written out
    field by field forgot fields twice (``expert_layout``, then ``host``: a plugin's CPU needs
    were ignored); made from :func:`dataclasses.fields`, a field added to a value type is kept
    without anyone remembering to copy it.
    """
    values = {f.name: plain(getattr(item, f.name)) for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    return cls(**{**values, **changes})
