"""The methods of one key side by side: what the MoE measurement and the dense one share.

Both of tune's measurements (:mod:`.measure`, the experts; :mod:`.dense_measure`, attention, router
and lm_head) take the same steps for every candidate method of a key: ask the registry whether it
can run here, build it behind the one boundary for plugin code (:func:`quantreg.hookcall.call`),
check it against float64, time it in interleaved rounds (:mod:`.rounds`) and refuse it, with the
reason, the moment it fails. Each measurement says only what differs: which methods are
candidates, how one is built, checked and run for one timed forward, and what a right output is.
The steps themselves are written once, here, so the two cannot drift apart (they had: two copies
of the build loop, of the refusal and of the timed call).

No torch: the layers and tensors are the subclasses'.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..hookcall import call
from ..problems import describe, printable
from .rank import Result
from .rounds import Progress, timing_rounds

if TYPE_CHECKING:
    from ..keys import Key
    from ..registry import Registry


class SideBySide:
    """Candidate methods of one key: built once, then checked and timed side by side.

    ``results`` holds a :class:`~.rank.Result` for every candidate; ``layers`` what each built
    method runs on, for those still in the race (a refused method's are dropped at once, so its
    memory comes back before the next is timed).
    """

    def __init__(self, registry: Registry, key: Key, progress: Progress) -> None:
        self.registry, self.key, self.progress = registry, key, progress
        self.results: dict[str, Result] = {}
        self.layers: dict[str, Any] = {}

    def candidates(self) -> list[str]:
        """The methods this measurement builds, by name (those that cannot run here too: they are reported)."""
        raise NotImplementedError

    def owner(self, name: str) -> str:
        """Who wrote ``name``, for a failure's text: ``plugin 'X'`` or ``vLLM``."""
        method = self.registry.methods.get(name)
        return f"plugin '{printable(method.plugin)}'" if method is not None else "vLLM"

    def build_all(self, build: Callable[[str], Any]) -> None:
        """Every candidate that can run here built by ``build(name)``; a method that cannot run or
        build is reported in its result, never chosen. Plugin code (import, constructor,
        ``create_weights``, ``process_weights_after_loading``) runs behind the one boundary: anything
        it raises, ``SystemExit`` included, is this method's failure alone."""
        names = self.candidates()
        for i, name in enumerate(names):
            self.progress(f"{self.key}: build {name}", i / max(len(names), 1))
            result = self.results[name] = Result(name)
            avail = self.registry.availability_for(name, self.key)
            if not avail.ok:  # vLLM's own reason already says "cannot run here"
                result.error = avail.reason if "cannot run here" in avail.reason else f"cannot run here: {avail.reason}"
                continue
            built, error = call(f"building method '{printable(name)}' ({self.owner(name)})",
                                functools.partial(build, name))
            if error is not None:
                result.error = f"build failed: {error}"
            else:
                self.layers[name] = built
            gc.collect()  # a failed build's half-made layers: freed before the next method builds

    def run(self, name: str, tokens: int, forward: Callable[[], Any]) -> tuple[Any, str | None]:
        """One untimed forward of ``name`` (the float64 check) behind the plugin-code boundary."""
        return call(f"running method '{printable(name)}' ({self.owner(name)}) at {tokens} token(s)", forward)

    def time_rounds(self, names: Sequence[str], tokens: Sequence[int], deadline: float,
                    forward: Callable[[str, int], Any], problem: Callable[[Any, int], str | None]) -> int:
        """Interleaved timing rounds (:func:`.rounds.timing_rounds`) until ``deadline``; returns the rounds.

        ``forward(name, t)`` is the timed span alone; ``problem(out, t)`` says why its output is not
        right (``None``: it is), checked outside the span, for every timed output. A forward that
        raises (``SystemExit`` too, never ``KeyboardInterrupt``) or returns a wrong output refuses
        its method with the token count. Its stdout goes to stderr (``--json`` keeps stdout for its
        object).
        """
        def timed(name: str, t: int) -> tuple[float, str | None]:
            out, error = None, None
            start = time.perf_counter()
            try:  # token counts the check did not run: the method may fail here first
                with contextlib.redirect_stdout(sys.stderr):
                    out = forward(name, t)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # SystemExit too: this method's fault, not tune's
                error = describe(exc)
            elapsed = (time.perf_counter() - start) * 1000.0
            return elapsed, error if error is not None else problem(out, t)

        return timing_rounds(str(self.key), names, tokens, self.layers, self.results, timed, self.refuse, deadline,
                             self.progress)

    def refuse(self, name: str, error: str) -> None:
        """A method that failed while being timed: refused like one that failed the check."""
        result = self.results[name]
        result.ok, result.error, result.samples, result.ms = False, error, {}, {}
        self.layers.pop(name, None)

    def drop_refused(self) -> None:
        """Refused methods' layers dropped (not timed, memory back)."""
        for name in [n for n, r in self.results.items() if not r.ok and n in self.layers]:
            del self.layers[name]
        gc.collect()

    def close(self) -> None:
        self.layers.clear()
        gc.collect()
