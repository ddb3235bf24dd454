"""The load loop (:mod:`quantreg.loading`): what a registry is built from, gathered through the hooks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import quantreg
from quantreg import builtin
from quantreg.registry import Registry
from quantreg.table.file import Layer


class _TablePlugin:
    def __init__(self, path: Path) -> None:
        self.path = path

    @quantreg.hookimpl
    def register_tables(self, register: Callable[[Path | str], None]) -> None:
        register(self.path)


def test_the_default_table_is_registered_through_the_builtin_plugins_hook(table: Any) -> None:
    """hookspecs/builtin promise it; loading once wired the file by hand beside the hooks (issue 24.2)."""
    calls = [(name, str(path)) for name, path in
             Registry.build(entry_points=False).plugins.call_each("register_tables")]
    assert calls == [(builtin.NAME, str(builtin.default_table_path()))]
    plugin_table = table("mine.yaml", """
        version: 1
        rules:
          - match: {quant_format: fp8}
            method: vllm
        """)
    registry = Registry.build(entry_points=False, plugins=[("mine", _TablePlugin(plugin_table))])
    assert [(t.path, t.layer) for t in registry.tables] == [
        (str(builtin.default_table_path()), Layer.DEFAULT), (str(plugin_table), Layer.PLUGIN)]


def test_a_swapped_default_table_replaces_the_builtin_plugins_one(table: Any) -> None:
    swapped = table("default.yaml", """
        version: 1
        rules:
          - match: {quant_format: fp8}
            method: vllm
        """)
    registry = Registry.build(entry_points=False, default_table=swapped)
    assert [(t.path, t.layer) for t in registry.tables] == [(str(swapped), Layer.DEFAULT)]
