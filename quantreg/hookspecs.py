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

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .methods import Method

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
def register_tables(register: Callable[[Path | str], None]) -> None:
    """Contribute rule tables: call ``register(path)`` for each YAML file the plugin ships.

    Plugin tables form the ``plugin`` layer: they beat the default table and lose to user
    files. Two plugins claiming the same key with equal specificity and priority is an error.
    """
