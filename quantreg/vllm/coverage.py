"""No routed-experts layer slips past the registry: subclasses that override the seam.

The seam (:mod:`.seam`) wraps ``RoutedExperts._get_quant_method``. A subclass that overrides it
changes what its layers get:

* **without** ``super()`` (vLLM 0.33's ``MuseSparkRoutedExperts``) the base wrapper never runs, so
  the registry is never asked. quantreg wraps the override too and routes it exactly like the
  base: the override plays the part of "vLLM's own method" (decision ``vllm``, or the fallback
  when the registry's method cannot be built), the registry's method replaces it otherwise.
* **with** ``super()`` (``DeepseekV4HeterogeneousSharedRoutedExperts``, 0.32 and 0.33) the base
  wrapper runs inside and the registry decides, but the override may throw that choice away
  (return its own method). quantreg cannot know whether the substitute is right, so it calls the
  override unchanged and logs one WARNING per (class, key) when the result is not the method the
  registry built. When the override *raises* on the registry's method (DeepseekV4 requires an
  ``Mxfp4MoEMethod``), lenient mode warns and calls it again with vLLM's own choice underneath;
  strict mode fails with that error.

Which of the two an override is, is read from its code: an override that names
``_get_quant_method`` (``super()._get_quant_method(...)``, ``RoutedExperts._get_quant_method(self,
...)``) is treated as calling the base; one that does not, cannot reach it. If an override
treated as calling the base never does (it called something else under that name), the layer is
left as the override made it and one WARNING names the class and the key quantreg could not decide.

When are subclasses wrapped? At layer construction: quantreg wraps ``RoutedExperts.__init__``,
which every layer runs (it is what calls ``_get_quant_method``), and walks ``type(layer).__mro__``
for overrides not wrapped yet. Chosen over ``__init_subclass__`` because it sees the class that is
actually built, whenever and however it was defined: classes created before the seam was
installed, ``register_oot`` replacements, and overrides assigned to a class after its creation
(a re-assigned override is simply wrapped again). It leaves class creation alone (no chaining
with other ``__init_subclass__`` hooks), and costs one MRO walk per layer. What it cannot see, a
subclass whose ``__init__`` never runs ``RoutedExperts.__init__``, builds no working layer anyway.

Signatures: quantreg calls ``_get_quant_method(self, prefix, quant_config, moe_config)``. If the
base's signature differs, the seam stays inactive (:meth:`.seam.Seam.patch_module`); if an
override's differs, it is left unwrapped behind a pass-through that logs the WARNING once.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..keys import Key
from ..problems import quantreg_logger, strict_error
from .context import layer_key

if TYPE_CHECKING:
    from .route import Route


class Seam(Protocol):
    """What coverage needs of the seam (:class:`quantreg.vllm.seam.Seam` is it).

    Why a protocol and not an import: the seam makes its coverage (:meth:`Seam.coverage`), so
    coverage naming the seam's module would close an import circle; it needs only these three.
    """

    lock: threading.RLock
    run: Route  # the run's route: the mode in force

    def route(self, original: Callable[..., Any], layer: Any, prefix: str, quant_config: Any,
              moe_config: Any) -> Any: ...

logger = quantreg_logger("vllm.quantreg")

METHOD = "_get_quant_method"
MARK = "__quantreg_original__"
#: the parameters quantreg passes to the seam, in order
EXPECTED = ("self", "prefix", "quant_config", "moe_config")


def signature_problem(fn: Any) -> str | None:
    """``None`` when ``fn`` takes exactly ``(self, prefix, quant_config, moe_config)``, else what it takes.

    Names and kinds both count: quantreg passes the four positionally, and a renamed or added
    parameter means vLLM changed what the seam receives, which quantreg must not guess at.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return f"{fn!r} has no signature quantreg can read"
    names = tuple(p.name for p in params)
    positional = all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    if names == EXPECTED and positional:
        return None
    return f"({', '.join(str(p.replace(annotation=p.empty)) for p in params)})"


def override_kind(override: Any) -> str:
    """What a non-function override is, in words (``a staticmethod``, ``a callable MyType object``)."""
    if isinstance(override, staticmethod):
        return "a staticmethod"
    if isinstance(override, classmethod):
        return "a classmethod"
    return f"a callable {type(override).__name__} object" if callable(override) else f"{type(override).__name__!r}"


def bound_as_python_would(override: Any, layer: Any) -> Any:
    """``override`` as ``layer._get_quant_method`` would have been without quantreg: bound by its
    descriptor (a staticmethod unwrapped, a classmethod bound to the class), else the object itself
    (a callable instance stored on the class is called without ``layer``)."""
    getter = getattr(type(override), "__get__", None)
    return getter(override, layer, type(layer)) if getter is not None else override


def calls_base(fn: Any) -> bool:
    """True when the override's code names ``_get_quant_method`` (it can reach the base wrapper)."""
    code = getattr(fn, "__code__", None)
    return code is not None and METHOD in code.co_names


def class_name(cls: type[Any]) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass
class Frame:
    """What happened under one override's call, for one layer.

    ``decided``: the registry was asked (by the base wrapper or a no-``super()`` wrapper);
    ``kept``: vLLM's own method (or the override standing in for it) was called;
    ``built``: the registry's method when it was returned instead; ``force_vllm``: the base
    wrapper must call vLLM's function without asking the registry (the lenient retry).
    """

    layer: Any
    decided: bool = False
    kept: bool = False
    built: Any = None
    force_vllm: bool = False
    reported: bool = False


class Coverage:
    """Wraps ``RoutedExperts.__init__`` and every override of the seam; undoes both."""

    def __init__(self, seam: Seam) -> None:
        self.seam = seam
        self.base: type[Any] | None = None
        self.init: Any = None
        self.wrapped: list[tuple[type[Any], Any]] = []
        self.warned: set[tuple[str, str]] = set()
        self.local = threading.local()

    # -- frames --------------------------------------------------------------------------
    def _stack(self) -> list[Frame]:
        stack: list[Frame] | None = getattr(self.local, "stack", None)
        if stack is None:
            stack = self.local.stack = []
        return stack

    def current(self, layer: Any) -> Frame | None:
        stack = self._stack()
        return stack[-1] if stack and stack[-1].layer is layer else None

    @contextmanager
    def frame(self, layer: Any) -> Iterator[Frame]:
        outer = self.current(layer)
        frame = Frame(layer, force_vllm=outer.force_vllm if outer is not None else False)
        stack = self._stack()
        stack.append(frame)
        try:
            yield frame
        finally:
            stack.pop()
            if outer is not None:  # an override further down the MRO, called through super()
                outer.decided |= frame.decided
                outer.kept |= frame.kept
                outer.reported |= frame.reported
                if frame.built is not None:
                    outer.built = frame.built

    def decide(self, own: Callable[..., Any], layer: Any, prefix: str, quant_config: Any, moe_config: Any) -> Any:
        """The seam's routing of one call, ``own`` standing for "vLLM's own method", recorded in the
        layer's frame when an override is running.

        ``own`` is vLLM's function (the base wrapper) or a no-``super()`` override.
        """
        frame = self.current(layer)
        if frame is None:
            return self.seam.route(own, layer, prefix, quant_config, moe_config)
        if frame.force_vllm:
            frame.kept = True
            return own(layer, prefix, quant_config, moe_config)
        frame.decided = True

        def kept(*args: Any) -> Any:
            frame.kept = True
            return own(*args)

        result = self.seam.route(kept, layer, prefix, quant_config, moe_config)
        if not frame.kept:
            frame.built = result
        return result

    # -- installing ----------------------------------------------------------------------
    def install(self, base: type[Any]) -> None:
        """Wrap ``base.__init__`` so every layer's class is covered before it asks for a method."""
        init = base.__dict__.get("__init__")
        if init is None or getattr(init, MARK, None) is not None:
            self.base = base
            return

        @functools.wraps(init)
        def __init__(layer: Any, *args: Any, **kwargs: Any) -> None:
            self.cover(type(layer))
            init(layer, *args, **kwargs)

        setattr(__init__, MARK, init)
        base.__init__ = __init__
        self.base, self.init = base, init

    def uninstall(self) -> None:
        base, self.base = self.base, None
        current = base.__dict__.get("__init__") if base is not None else None
        if base is not None and self.init is not None and getattr(current, MARK, None) is self.init:
            base.__init__ = self.init
        self.init = None
        for cls, original in reversed(self.wrapped):
            if getattr(cls.__dict__.get(METHOD), MARK, None) is original:
                setattr(cls, METHOD, original)
        self.wrapped.clear()
        self.warned.clear()

    def cover(self, cls: type[Any]) -> None:
        """Wrap each override of the seam in ``cls``'s MRO (below the base) not wrapped yet."""
        base = self.base
        if base is None or cls is base:
            return
        for klass in cls.__mro__:
            if klass is base:
                break
            override = klass.__dict__.get(METHOD)
            if override is None or getattr(override, MARK, None) is not None:
                continue
            with self.seam.lock:
                if klass.__dict__.get(METHOD) is override:
                    wrapper = self.wrap(klass, override)
                    setattr(wrapper, MARK, override)
                    setattr(klass, METHOD, wrapper)
                    self.wrapped.append((klass, override))

    def wrap(self, cls: type[Any], override: Any) -> Callable[..., Any]:
        """The wrapper of one override: routed (no ``super()``), checked (``super()``), or passed through."""
        problem = signature_problem(override) if inspect.isfunction(override) else f"is {override_kind(override)}"
        name = class_name(cls)
        if problem is not None:
            what = problem if problem.startswith("is ") else f"takes {problem}, not ({', '.join(EXPECTED)})"

            def passthrough(layer: Any, *args: Any, **kwargs: Any) -> Any:
                self.warn_once(name, self.key_of(layer),
                               f"{name}.{METHOD} {what}: quantreg cannot route it and could not decide "
                               f"{self.key_of(layer)} for its layers (the subclass chooses)")
                return bound_as_python_would(override, layer)(*args, **kwargs)
            with contextlib.suppress(Exception):  # a callable object may lack (or lie about) __name__ etc.
                functools.update_wrapper(passthrough, override)
            return passthrough

        if not calls_base(override):
            logger.info("quantreg: %s overrides %s without super(); quantreg routes its layers too "
                        "(decision 'vllm' keeps the override's own method)", name, METHOD)

            @functools.wraps(override)
            def routed(layer: Any, prefix: str, quant_config: Any, moe_config: Any) -> Any:
                return self.decide(override, layer, prefix, quant_config, moe_config)
            return routed

        @functools.wraps(override)
        def checked(layer: Any, prefix: str, quant_config: Any, moe_config: Any) -> Any:
            with self.frame(layer) as frame:
                try:
                    result = override(layer, prefix, quant_config, moe_config)
                except Exception as exc:
                    if frame.built is None or frame.force_vllm:
                        raise
                    return self.refused(name, layer, frame, exc,
                                        lambda: override(layer, prefix, quant_config, moe_config))
            key = self.key_of(layer)
            if not frame.decided:
                self.warn_once(name, key,
                               f"{name}.{METHOD} never reached quantreg's seam for {key}: quantreg could not decide "
                               f"this key for its layers (the subclass chose {type(result).__name__})")
            elif frame.built is not None and result is not frame.built and not frame.reported:
                frame.reported = True
                self.warn_once(name, key,
                               f"{name}.{METHOD} discarded the registry's choice for {key}: the registry built "
                               f"{type(frame.built).__name__}, the subclass returned {type(result).__name__} "
                               "instead (its layers do not run the table's method)")
            return result
        return checked

    def refused(self, name: str, layer: Any, frame: Frame, exc: Exception, again: Callable[[], Any]) -> Any:
        """The override raised on the registry's method: strict fails, lenient retries with vLLM's own."""
        key = self.key_of(layer)
        message = (f"quantreg: {name}.{METHOD} refused the registry's {type(frame.built).__name__} for {key}: "
                   f"{type(exc).__name__}: {exc}")
        if self.seam.run.registry()[1].strict:
            raise strict_error(message) from exc
        self.warn_once(name, key, f"{message}; using vLLM's own method for this class's layers")
        frame.built, frame.force_vllm = None, True
        try:
            return again()
        finally:
            frame.force_vllm = False

    def key_of(self, layer: Any) -> Key:
        """The layer's key; ``RoutedExperts.__init__`` sets ``quant_config`` before asking for a method."""
        return layer_key(getattr(layer, "quant_config", None))

    def warn_once(self, name: str, key: Key, message: str) -> None:
        if (name, str(key)) in self.warned:
            return
        self.warned.add((name, str(key)))
        logger.warning("quantreg: %s", message.removeprefix("quantreg: "))

