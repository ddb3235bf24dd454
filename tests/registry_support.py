"""Helpers for the registry tests: an in-process plugin that registers methods and tables through
the real hooks, a registry built from real table files per tier, and a writer of one-rule-per-line
tables. Shared by test_registry.py, test_registry_reference.py and test_methods_loading.py."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import quantreg
from quantreg import Method, Registry


class MethodsPlugin:
    """An in-process plugin: registers the given methods and tables through the real hooks."""

    def __init__(self, methods: Iterable[Method], tables: Iterable[Path] = ()) -> None:
        self.methods = list(methods)
        self.tables = list(tables)

    @quantreg.hookimpl
    def register_methods(self, register: Callable[[Method], None]) -> None:
        for m in self.methods:
            register(m)

    @quantreg.hookimpl
    def register_tables(self, register: Callable[[Path | str], None]) -> None:
        for t in self.tables:
            register(t)


def anywhere(name: str, **kw: Any) -> Method:
    """A method that can run everywhere; its target is never imported by these tests."""
    return Method(name=name, target=f"qrt_never_imported:{name}", **kw)


def build(
    *,
    default: Path | None = None,
    plugin_tables: Sequence[Path] = (),
    user: Sequence[Path] = (),
    run: Sequence[Path] = (),
    methods: Iterable[Method] = (),
    env: dict[str, str] | None = None,
) -> Registry:
    env = dict(env or {})
    if user:
        env["QUANTREG_CONFIG"] = os.pathsep.join(map(str, user))
    return Registry.build(config=run, env=env, entry_points=False, default_table=default,
                          plugins=[("test-plugin", MethodsPlugin(methods, plugin_tables))])


def rules_yaml(*rules: str) -> str:
    """A table with one flow-style rule per line: rule ``i`` is on line ``i + 3``."""
    if not rules:
        return "version: 1\nrules: []\n"
    return "version: 1\nrules:\n" + "".join(f"  - {r}\n" for r in rules)


LAYER_METHODS = [anywhere(n) for n in ("m_default", "m_plugin", "m_user", "m_user2", "m_run", "m_specific")]
