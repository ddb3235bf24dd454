"""The load loop (:mod:`quantreg.loading`): what a registry is built from, gathered through the hooks.

Also here (issue 24 class 5): a method defined in two user tables and literal config paths, from
test_containment_plugins.py (issue 12, plugin and start-up classes) (class 10) and test_hardening.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from core_support import GOOD_RULES, write

import quantreg
from quantreg import Registry, builtin
from quantreg.table.file import Tier


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
    assert [(t.path, t.tier) for t in registry.tables] == [
        (str(builtin.default_table_path()), Tier.DEFAULT), (str(plugin_table), Tier.PLUGIN)]


def test_a_swapped_default_table_replaces_the_builtin_plugins_one(table: Any) -> None:
    swapped = table("default.yaml", """
        version: 1
        rules:
          - match: {quant_format: fp8}
            method: vllm
        """)
    registry = Registry.build(entry_points=False, default_table=swapped)
    assert [(t.path, t.tier) for t in registry.tables] == [(str(swapped), Tier.DEFAULT)]


# -- from test_containment_plugins.py (issue 12, plugin and start-up classes) -----------------


@pytest.mark.usefixtures("clean_env")
def test_a_method_defined_in_two_user_tables_is_located(tmp_path: Path) -> None:
    spec = "allow_import_targets: true\nmethods:\n  twin:\n    target: qrt_x:Y\nrules: []\n"
    a = write(tmp_path / "a.yaml", "version: 1\n" + spec)
    b = write(tmp_path / "b.yaml", "version: 1\n# another comment line\n" + spec)
    registry = Registry.build(env={"QUANTREG_CONFIG": f"{a}{os.pathsep}{b}", "QUANTREG_PLUGINS": ""})
    [problem] = registry.problems
    assert str(problem) == f"{b}:5: methods.twin: method 'twin' is already registered by 'table {a}'"


# -- from test_hardening.py (strict vs lenient, fault isolation, security) --------------------


@pytest.mark.usefixtures("clean_env")
def test_config_paths_are_taken_literally(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "t.yaml").write_text(GOOD_RULES.replace("good", "vllm"))
    registry = Registry.build(env={"QUANTREG_CONFIG": "$HOME/t.yaml" + ":" + "~/t.yaml"})
    assert [str(p) for p in registry.problems] == ["$HOME/t.yaml: no such file", "~/t.yaml: no such file"]
