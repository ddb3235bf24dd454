"""quantreg.table.methods: methods defined in user tables import code only behind ``allow_import_targets:
true``, must still name a class, and plugin tables cannot define them.

History (issue 24 class 5): moved from tests/test_hardening.py (strict vs lenient, plugin fault
isolation, security) (security).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from core_support import PluginSite

from quantreg import Registry

pytestmark = pytest.mark.usefixtures("clean_env")


# -- from test_hardening.py (strict vs lenient, fault isolation, security) --------------------


def test_table_defined_target_needs_explicit_opt_in(tmp_path: Path) -> None:
    evil = tmp_path / "evil.yaml"
    evil.write_text(textwrap.dedent("""\
        version: 1
        methods:
          shell: {target: "os:system"}
        rules:
          - match: {device: cpu}
            method: shell
        """))
    registry = Registry.build(env={"QUANTREG_CONFIG": str(evil)})
    messages = [str(p) for p in registry.problems]
    assert f"{evil}:2: methods: table-defined methods import code named in the table: set " \
           "'allow_import_targets: true' in this table to allow them" in messages
    assert "shell" not in registry.methods and registry.resolve(("x", "y", "cpu")).method == "vllm"


def test_opted_in_target_must_still_be_a_class(tmp_path: Path) -> None:
    table = tmp_path / "mine.yaml"
    table.write_text(textwrap.dedent("""\
        version: 1
        allow_import_targets: true
        methods:
          shell: {target: "os:system", devices: cpu, options: []}
        rules:
          - match: {device: cpu}
            method: shell
        """))
    registry = Registry.build(env={"QUANTREG_CONFIG": str(table)})
    assert registry.problems == ()
    assert registry.methods["shell"].plugin == f"table {table}"
    assert registry.resolve(("x", "y", "cpu")).method == "shell"
    with pytest.raises(TypeError, match="target os:system is a builtin_function_or_method, not a class"):
        registry.methods["shell"].load()


def test_plugin_tables_cannot_define_methods(plugin_site: PluginSite) -> None:
    plugin_site.add("qrt-sneaky", {"sneaky": "qrt_sneaky"}, modules={"qrt_sneaky": """
import quantreg
from pathlib import Path

@quantreg.hookimpl
def register_tables(register):
    register(Path(__file__).with_name("qrt_sneaky.yaml"))
"""}, files={"qrt_sneaky.yaml": "version: 1\nallow_import_targets: true\nmethods:\n  x: {target: 'os:system'}\n"
                                "rules: []\n"})
    registry = Registry.build()
    assert any("only user and run tables may define methods" in str(p) for p in registry.problems)
    assert "x" not in registry.methods
