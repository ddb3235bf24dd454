"""The one route from a layer vLLM builds to the method that serves it: the run state, one decision, one build.

Why one route: the MoE seam (:mod:`.seam`), the dense seam (:mod:`.dense`) and a token split's
sides (:mod:`.token_split`) all take the same steps for a layer: the registry this run decides
with (its ``additional_config`` tables, the mode in force), one decision per key and its one log
line, strict mode's refusal of a chain with nothing that runs here, a tuned rule's evidence against
this process, and the decided plugin method built for the layer. They were written twice (the dense
seam borrowed the MoE seam's run state and copied its build); here they are written once and the
seams keep only what differs: which vLLM class they hook, which key field they set, what they
wrap the built method in.

Every plugin method is constructed behind :func:`quantreg.hookcall.call` (import, class check,
constructor): whatever plugin code raises there, ``SystemExit`` included, is that method's failure
(:class:`BuildFailed`), never the layer build's. A :class:`~quantreg.problems.QuantregError` is
already one strict line and passes unchanged.

Imported by ``register()``: no torch, no vLLM here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from .. import settings
from ..hookcall import call
from ..keys import Key
from ..methods import VLLM_METHOD, BuildContext, Method
from ..mode import Mode
from ..plugins import PluginFailure
from ..problems import STRICT_PREFIX, Problem, QuantregError, describe, printable, quantreg_logger, strict_error
from ..registry import Registry, get_registry
from . import startup
from .context import RunSettings, report_problems, run_settings

if TYPE_CHECKING:
    from ..decision import Decision

logger = quantreg_logger("vllm.quantreg")

T = TypeVar("T")


class BuildFailed(Exception):
    """A plugin method could not be built; the text is plugin code's fault as one line (``Type: text``)."""


def failure_text(exc: BaseException) -> str:
    """``Type: text`` of a failure to build: a :class:`BuildFailed` already says it."""
    return str(exc) if isinstance(exc, BuildFailed) else f"{type(exc).__name__}: {exc}"


class _Passed:
    """A ``QuantregError`` raised inside plugin code's call, carried out of it to be raised again."""

    def __init__(self, error: QuantregError) -> None:
        self.error = error


def build(method: Method, first: Any, context: BuildContext, base: type[Any] | None) -> Any:
    """``method`` built for one layer (:meth:`quantreg.methods.Method.build`) behind the one caller of plugin code.

    ``first`` is what the method class takes first (vLLM's ``moe_config`` for the experts, the
    method vLLM chose for a dense layer kind); ``base`` the vLLM class it must extend. Raises
    :class:`BuildFailed` with the fault as one line, or the ``QuantregError`` plugin code raised.
    """
    def construct() -> Any:
        try:
            return method.build(first, context, base=base)
        except QuantregError as exc:  # already one strict line: passed on, never wrapped in a second prefix
            return _Passed(exc)

    owner = printable(method.plugin) or "quantreg"
    built, error = call(f"building method '{printable(method.name)}' ({owner}) for {printable(context.prefix)}",
                        construct)
    if error is not None:
        raise BuildFailed(error)
    if isinstance(built, _Passed):
        raise built.error
    return built


class Route:
    """The run state every seam shares (registry, mode, the once-per-key lines) and the decide-and-build steps."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.logged: set[Key] = set()
        self.stale_logged: set[tuple[Key, str]] = set()
        self.build_failed: set[tuple[Key, str, str, str, str]] = set()
        self.settings: RunSettings | None = None

    def forget(self) -> None:
        """Back to a fresh process's state (``unregister()``, tests)."""
        with self.lock:
            self.logged.clear()
            self.stale_logged.clear()
            self.build_failed.clear()
            self.settings = None

    # -- the run ---------------------------------------------------------------------------
    def registry(self) -> tuple[Registry, Mode]:
        """The registry with this run's ``additional_config`` tables, and the mode in force.

        The mode is :meth:`Registry.mode` with the run's own ``strict`` added, the same rule
        ``register()`` applied without it. A rebuilt registry reports its faults once (warnings,
        or the error if strict); in strict mode the faults ``register()`` only warned about (the
        run asked for strict later) become the error too.
        """
        run = run_settings()
        with self.lock:
            registry, rebuilt = startup.registry_for_run(run, self.settings)
            self.settings = run
        mode = startup.mode_of(registry, run)
        report_problems(run, strict=mode.strict)
        if rebuilt or mode.strict:
            report_faults(registry, strict=mode.strict)
        return registry, mode

    # -- deciding ---------------------------------------------------------------------------
    def decide(self, key: Key, shape: Callable[[], Mapping[str, int] | None], *,
               every_side: bool) -> tuple[Registry, Mode, Decision]:
        """The decision for ``key``, logged once; strict refuses a chain with nothing that runs here.

        ``every_side``: a split decision's sides each count (the MoE seam builds every side); else
        only the decision itself (the dense seam builds one method per layer). ``shape`` gives the
        layer's sizes for a tuned rule's ``shape`` pin, asked only when a tuned rule decides.
        """
        registry, mode = self.registry()
        decision = registry.resolve(key)
        self.log_once(decision, registry)
        sides = [s.decision for s in decision.sides] if every_side else [decision]
        unrunnable = [one for one in sides if one.fallback]
        if unrunnable and mode.strict:  # every side, the same reading as every tool's verdict (envelope)
            from ..answer import chain_notes

            raise strict_error(f"{decision.summary()}; " + "; ".join(chain_notes(unrunnable[0])))
        for one in sides:  # a split: every side, each by its own rule
            self.check_tuned(one, registry, shape, mode.strict)
        return registry, mode, decision

    def check_tuned(self, decision: Decision, registry: Registry, shape: Callable[[], Mapping[str, int] | None],
                    strict: bool) -> None:
        """A tuned rule's evidence against this process (:mod:`quantreg.pins`), the layer's shape included.

        Lenient: one WARNING per differing field, once per key; the rule still decides as written
        (the decision, the trail and the fingerprint carry the flag). Strict: one
        ``quantreg (strict):`` line naming every field, and no start.
        """
        rule = decision.rule
        if rule is None or rule.tuned is None or (decision.key, rule.location) in self.stale_logged:
            return
        self.stale_logged.add((decision.key, rule.location))
        texts = list(decision.stale)
        sizes = shape()
        if sizes is not None:
            texts += [s.text() for s in registry.stale_evidence(rule, sizes) if s.field == "shape"]
        if not texts:
            return
        where = f"{decision.key} [{decision.source}]"
        if strict:
            raise strict_error(f"tuned rule for {where} was measured elsewhere: " + "; ".join(texts))
        for text in texts:
            logger.warning("quantreg: tuned rule for %s is stale: %s; the rule still decides (re-run quantreg tune)",
                           where, text)

    def log_once(self, decision: Decision, registry: Registry | None = None) -> None:
        """One line per key, the same :class:`~quantreg.answer.Answer` line ``explain`` and ``plan`` give.

        WARNING when an operator should act (a fallback, vLLM's known limitation, a plugin's
        warning), else INFO. Never raises: the line is a report, the decision is already made.
        """
        if decision.key in self.logged:
            return
        self.logged.add(decision.key)
        registry = get_registry() if registry is None else registry
        startup.record_decision(decision, registry, self.settings)  # QUANTREG_DECISIONS, once per key
        try:
            from ..answer import answer

            said = answer(registry, decision.key)
            line, warns = said.line(), said.warns
        except Exception as exc:  # a report must not stop a layer that is already decided
            line = f"{decision.summary()}; (notes unavailable: {type(exc).__name__}: {exc})"
            warns = bool(decision.fallback)
        (logger.warning if warns else logger.info)("quantreg: %s", line)

    # -- building ---------------------------------------------------------------------------
    @staticmethod
    def build(decision: Decision, registry: Registry, first: Any, prefix: str, layer: Any,
              base: type[Any] | None) -> Any:
        """The decided method built for this layer (the layer in its :class:`BuildContext`); raises."""
        context = BuildContext(decision.key, decision.method, decision.source, decision.options, prefix, layer)
        return build(registry.methods[decision.method], first, context, base)

    def method_or_none(self, decision: Decision, registry: Registry, first: Any, prefix: str, layer: Any,
                       base: type[Any] | None, strict: bool, where: str = "") -> tuple[Decision, Any]:
        """:meth:`build`, continuing down the rule's chain and then the next rules' when construction fails.

        Returns the decision that serves the layer and its built method (``None``: vLLM's own method
        serves). A failed construction (whatever plugin code raised, ``QuantregError`` included, or
        an object that is not the method's: :meth:`quantreg.methods.Method.build`) is, lenient, one
        WARNING naming the method, its plugin and what serves instead: the next method known to run
        here (:meth:`~quantreg.registry.Registry.next_choices`, as ``explain`` reads it), vLLM's own
        only when none is left. Strict: one ``quantreg (strict):`` line. ``where`` follows "could not
        be built" in the line. Why not straight to vLLM's own method: on a host where it cannot run
        (GPT-OSS MXFP4 on a CPU without AMX) that took EngineCore down while a rule offered a method
        that runs.
        """
        choices = [decision, *registry.next_choices(decision)]
        tried: set[tuple[str, str]] = set()
        for i, current in enumerate(choices):
            if current.keeps_vllm:
                return current, None
            mark = (current.method, repr(sorted(current.options.items())))
            if mark in tried:
                continue
            tried.add(mark)
            try:
                return current, self.build(current, registry, first, prefix, layer, base)
            except QuantregError as exc:
                if strict and str(exc).startswith(STRICT_PREFIX):  # one strict line already: never a second prefix
                    raise
                error: Exception = exc
            except Exception as exc:
                error = exc
            message = (f"quantreg: method '{current.method}' ({owner_of(registry, current.method)}) for "
                       f"{current.key} [{current.source}] could not be built{where}: {failure_text(error)}")
            if strict:
                raise strict_error(message) from error
            following = next((c for c in choices[i + 1:]
                              if c.keeps_vllm or (c.method, repr(sorted(c.options.items()))) not in tried), None)
            serving = following if following is not None else replace(decision, method=VLLM_METHOD, options={})
            instead = (f"using '{serving.method}' [{serving.source}], the next method known to run here"
                       if following is not None and not following.keeps_vllm else
                       "using vLLM's own method" + ("" if following is not None else
                                                    last_resort(registry, decision.key)))
            once = (current.key, current.method, current.source, serving.method, serving.source)
            if once not in self.build_failed:  # one line per key (every layer of it fails alike), as decisions
                self.build_failed.add(once)
                logger.warning("%s; %s", printable(message), instead)
                record_failed(current, serving, failure_text(error))
            else:
                logger.debug("%s; %s", printable(message), instead)
            if following is None:
                return serving, None
        return replace(decision, method=VLLM_METHOD, options={}), None  # every choice was tried already

    def split_side(self, one: Decision, tokens: str, registry: Registry, first: Any, prefix: str, layer: Any,
                   base: type[Any] | None, strict: bool, vllms: Callable[[], Any],
                   wrap: Callable[[Any, Decision], Any]) -> tuple[Decision, Any]:
        """One side of a ``tokens:`` split (``one``, for forwards of ``tokens``) built down :meth:`method_or_none`.

        Returns the decision that serves the side and its method: ``vllms()`` where the side keeps
        vLLM's own method or its walk ends there, else ``wrap(method, serving)`` (the seam's
        ``verify:``). Why the walk and not a plain :meth:`build`: a side whose constructor failed
        was dropped, and plugin code's ``QuantregError`` took the whole layer to vLLM's own method,
        which may not run here (GPT-OSS MXFP4 on a CPU without AMX) while the side's rules offered
        one that does. A side decision is its range's own decision (``Registry._decide_rule`` over
        the rules covering the range): its ``rule`` is the range's winner and its method that
        rule's chain's, so the walk is the rest of that chain, then the covering rules that lost;
        the rules of other ranges are never walked (they do not serve these token counts). Should a
        side's method not be in its rule's chain, the walk starts at the losing rules' chains.
        Strict: one ``quantreg (strict):`` line, as for any method.
        """
        if one.keeps_vllm:
            return one, vllms()
        serving, method = self.method_or_none(one, registry, first, prefix, layer, base, strict,
                                              where=f" for {printable(prefix)} (the tokens{tokens} side of a "
                                                    "tokens: split)")
        if method is None:
            return serving, vllms()
        return serving, wrap(method, serving)

    # -- the boundary -----------------------------------------------------------------------
    @staticmethod
    def contained(prefix: str, work: Callable[[], T], fallback: Callable[[], T],
                  passes: Callable[[BaseException], bool] = lambda exc: False) -> T:
        """A seam's one boundary: quantreg's faults never stop a layer build unasked.

        Lenient, anything unexpected in quantreg's part (whatever its class) is a WARNING and
        ``fallback()`` (vLLM's own method) answers; strict, it is one ``QuantregError`` line. What
        ``passes`` names (vLLM's own method raising) goes through untouched, as does
        ``KeyboardInterrupt``; a ``QuantregError`` (already one line) passes when strict, and is
        contained like the rest when lenient (plugin code may raise the public class too).
        """
        try:
            return work()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            if passes(exc) or (isinstance(exc, QuantregError) and startup.strict_now()):
                raise
            message = f"quantreg: routing {printable(prefix)} failed unexpectedly: {printable(describe(exc))}"
            if startup.strict_now():
                raise strict_error(message) from None
            logger.warning("%s; using vLLM's own method", message)
        return fallback()


def owner_of(registry: Registry, method: str) -> str:
    """``plugin 'x' (distribution d)`` / ``table PATH`` / ``quantreg``: whose code a method is, for a fault line."""
    found = registry.methods.get(method)
    plugin = found.plugin if found is not None else ""
    if not plugin:
        return "quantreg"
    if plugin.startswith("table "):
        return printable(plugin)
    dist = next((i.distribution for i in registry.plugin_infos if i.name == plugin), "")
    return f"plugin '{printable(plugin)}'" + (f", distribution {printable(dist)}" if dist and dist != "?" else "")


def last_resort(registry: Registry, key: Key) -> str:
    """What the WARNING adds when vLLM's own method takes a layer no other method could: whether it runs here."""
    here = registry.availability_for(VLLM_METHOD, key)
    return " (no other method of the matching rules is known to run here" + (
        ")" if here.ok else f"; and {here.reason})")


def record_failed(failed: Decision, serving: Decision, error: str) -> None:
    """One ``build_failed`` event in the ``QUANTREG_DECISIONS`` trail: the decision it recorded names a method
    that does not serve; this line names the one that does (never raises, like every trail write)."""
    if not startup._trail_asked_for():
        return
    from ..audit import append_record, utc_time

    append_record({"event": "build_failed", "time": utc_time(), "key": failed.key.as_json(),
                   "method": failed.method, "rule": failed.source, "error": error,
                   "serving": serving.method, "serving_rule": serving.source})


def report_faults(registry: Registry, strict: bool) -> None:
    """Strict: raise one error with every fault. Lenient: one WARNING line per fault, saying what was left out.

    A table problem leaves its whole file out (not just the rule it names), a plugin failure
    leaves out what that plugin's hook registered, an environment problem falls back to the
    setting's default; the warning says which, so nobody reads it as "only this rule was dropped".
    """
    faults = registry.faults
    if not faults:
        return
    if strict:
        raise strict_error("; ".join(map(str, faults)))
    for fault in faults:
        logger.warning("quantreg: %s (%s)", fault, consequence(fault))


def consequence(fault: Problem | PluginFailure) -> str:
    """What a lenient start-up does about ``fault``, for its warning line."""
    if isinstance(fault, PluginFailure):
        return "left out; the other plugins and tables stay in force"
    if fault.path == settings.ENVIRONMENT:
        return "the default is used"
    return "this file is left out whole; the other tables stay in force"
