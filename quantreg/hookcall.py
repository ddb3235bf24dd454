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
- :func:`registered_type` reads, from the hookspec itself, the type a hook's ``register``
  callback takes (``Callable[[Method], None]`` -> ``Method``), and :func:`value_problem` checks an
  item against it *and* each of its dataclass fields against their annotations. So a new hook
  is contained and type-checked by being declared in :mod:`quantreg.hookspecs`.

``os._exit`` and signals cannot be contained in-process (docs/operating.md).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import types
import typing
from collections.abc import Callable
from typing import Any

from .plugins import plugin_code
from .problems import describe, printable

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


# -- what a hook's register() takes, from the hookspec ---------------------------------------------

@functools.cache
def hook_names() -> tuple[str, ...]:
    """Every hook declared in :mod:`quantreg.hookspecs` (a function carrying pluggy's spec mark)."""
    from . import hookspecs

    return tuple(sorted(n for n in dir(hookspecs) if hasattr(getattr(hookspecs, n), f"{hookspecs.PROJECT}_spec")))


@functools.cache
def _type_only_imports() -> dict[str, str]:
    """Name -> module of what hookspecs imports under ``if TYPE_CHECKING:``, read from its source.

    Why from the source: the hookspec module is the one declaration; resolving a hook's types
    must not import every other hook's types (``register()`` in vLLM would pay for findings and
    limitations it never uses), so each name's module is imported only when a hook needs it.
    """
    import ast
    import inspect

    from . import hookspecs

    source = inspect.getsource(hookspecs)  # any loader (pytest's assertion rewriter has no get_source)
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and stmt.level == 1 and stmt.module:
                    for alias in stmt.names:
                        found[alias.asname or alias.name] = f"quantreg.{stmt.module}"
    return found


def _namespace(annotation: str) -> dict[str, Any]:
    """hookspecs' globals plus the type-checking-only names ``annotation`` uses, imported now."""
    import importlib
    import re

    from . import hookspecs

    namespace = dict(vars(hookspecs))
    for name, module in _type_only_imports().items():
        if re.search(rf"\b{re.escape(name)}\b", annotation):
            namespace[name] = getattr(importlib.import_module(module), name)
    return namespace


@functools.cache
def registered_type(hook: str) -> Any:
    """The type hint of the one argument of hook ``hook``'s ``register`` callback."""
    from . import hookspecs

    spec = getattr(hookspecs, hook)
    annotation = spec.__annotations__.get("register", "")
    # Only this one annotation is evaluated (the others may name types this hook does not need);
    # it is quantreg's own source text, never input.
    register = eval(str(annotation), _namespace(str(annotation)))
    args = typing.get_args(register)  # Callable[[X], None] -> ([X], None)
    if not args or not isinstance(args[0], list) or len(args[0]) != 1:
        raise TypeError(f"hookspec {hook}: register must be declared Callable[[T], None]")
    return args[0][0]


def hook_argnames(hook: str) -> tuple[str, ...]:
    """The arguments hook ``hook`` is declared with (``register`` first)."""
    from . import hookspecs

    return tuple(getattr(hookspecs, hook).__code__.co_varnames[:getattr(hookspecs, hook).__code__.co_argcount])


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
    if isinstance(hint, type):
        import quantreg

        public = "quantreg" if getattr(quantreg, hint.__name__, None) is hint else hint.__module__
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
