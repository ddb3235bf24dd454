"""The plugin API: the hooks a quantreg plugin may implement.

A plugin is a module (or object) exposed through the ``quantreg`` entry-point group whose
functions are marked with :data:`hookimpl`. Each hook receives a ``register`` callback rather
than returning values, so the registry knows which plugin registered what and can keep one
faulty registration from spoiling the others. The built-in ``vllm`` method and the default
table are registered through these same hooks (see :mod:`quantreg.builtin`).

Every hook here must be documented in ``docs/plugins.md`` with its exact signature and be
exercised by a test; ``tests/test_hook_docs.py`` enforces both.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import os
import re
import sys
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from .decision import Decision
    from .findings import Finding
    from .keepers import QuantConfigKeeper
    from .keys import Key
    from .methods import Method
    from .vllm_limits import VllmLimitation

PROJECT = "quantreg"

#: Marks the hook specifications below (pluggy's marker is typed: decorated functions keep their signatures).
hookspec = pluggy.HookspecMarker(PROJECT)
#: Marks a plugin function as a quantreg hook implementation: ``@quantreg.hookimpl``.
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_methods(register: Callable[[Method], None]) -> None:
    """Register MoE methods: call ``register(Method(name=..., target="pkg.mod:Class", ...))``.

    Called once per registry build. Targets are imported only when a method is chosen or
    probed, so keep heavy imports (torch, device runtimes) inside the target module.
    """


@hookspec
def register_tables(register: Callable[[str | os.PathLike[str]], None]) -> None:
    """Contribute rule tables: call ``register(path)`` for each YAML file the plugin ships.

    Plugin tables form the ``plugin`` tier (the built-in plugin's one table is the ``default``
    tier, see :mod:`quantreg.builtin`): they beat the default table and lose to user
    files. Two plugins claiming the same key with equal specificity and priority is an error.
    """


@hookspec
def register_quant_config_keepers(register: Callable[[QuantConfigKeeper], None]) -> None:
    """Declare quant configs a third party may strip before vLLM fixes them, and how to keep them.

    Call ``register(QuantConfigKeeper(...))`` (see :mod:`quantreg.keepers`). In every vLLM
    process quantreg calls the keeper's target right after the stripping module is imported,
    handing it a ``should_keep()`` that answers from the table's decision for the keeper's key
    on this device: a quantreg method keeps the config, ``vllm`` leaves the third party alone.
    """


@hookspec
def doctor_findings(register: Callable[[Finding], None], resolve: Callable[[Key], Decision],
                    device: str) -> None:
    """Say what your stack does to keys on this host: call ``register(quantreg.Finding(level, message, key))``.

    ``resolve(key)`` answers from the tables of the asking tool (``doctor``, ``explain``,
    ``plan`` with their ``--config`` tables, or the start-up decision); ``device`` is vLLM's
    device or, when a tool runs outside vLLM and none is given, the one vLLM would most likely
    report (never ``None``). Implementations may take any subset of the three arguments. Every
    tool asks this one hook (:mod:`quantreg.answer`), so what a plugin says here is what
    ``explain``, ``plan`` and ``doctor`` print: never re-derived in core. Keep it cheap and free
    of torch/vLLM imports.
    """


@hookspec
def register_vllm_limitations(register: Callable[[VllmLimitation], None]) -> None:
    """Tell quantreg which keys vLLM's own method cannot run on your device: ``register(VllmLimitation(...))``.

    ``explain`` and ``plan`` show the limitation's note when a key that matches it (and whose
    ``applies`` check holds on this host) is decided ``vllm``, so the operator reads it before a
    server fails at start-up. Checks must be cheap and must not import vLLM or torch; they are
    called in the CLI, not inside vLLM (see :mod:`quantreg.vllm_limits`).
    """


# -- what each hook's register() takes, read from the specs above ---------------------------------
# Why here: this module is the one declaration of the hooks; the plugin loader
# (:meth:`quantreg.plugins.Plugins.call_each`) asks it what a hook registers and hands that type to
# :func:`quantreg.hookcall.value_problem`, so the caller of plugin code needs no import of the specs.

@functools.cache
def hook_names() -> tuple[str, ...]:
    """Every hook declared here (a function carrying pluggy's spec mark)."""
    here = globals()
    return tuple(sorted(n for n, v in here.items() if hasattr(v, f"{PROJECT}_spec")))


@functools.cache
def _type_only_imports() -> dict[str, str]:
    """Name -> module of what this module imports under ``if TYPE_CHECKING:``, read from its source.

    Why from the source: resolving a hook's types must not import every other hook's types
    (``register()`` in vLLM would pay for findings and limitations it never uses), so each name's
    module is imported only when a hook needs it.
    """
    source = inspect.getsource(sys.modules[__name__])  # any loader (pytest's assertion rewriter has no get_source)
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and stmt.level == 1 and stmt.module:
                    for alias in stmt.names:
                        found[alias.asname or alias.name] = f"quantreg.{stmt.module}"
    return found


def _namespace(annotation: str) -> dict[str, Any]:
    """This module's globals plus the type-checking-only names ``annotation`` uses, imported now."""
    namespace = dict(globals())
    for name, module in _type_only_imports().items():
        if re.search(rf"\b{re.escape(name)}\b", annotation):
            namespace[name] = getattr(importlib.import_module(module), name)
    return namespace


@functools.cache
def registered_type(hook: str) -> Any:
    """The type hint of the one argument of hook ``hook``'s ``register`` callback."""
    spec = globals()[hook]
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
    code = globals()[hook].__code__
    return tuple(code.co_varnames[:code.co_argcount])
