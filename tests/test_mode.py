"""Strict or lenient (:mod:`quantreg.mode`): ``decide_mode`` is the one place it is decided.

History: ``register()`` once ORed in the strictness a driver shipped to its workers
(``multinode.published_strict()``) beside ``decide_mode``, so the seam's later checks and the
CLI did not see it, and ``_strict_now`` existed twice (issue 24.3). Now every vLLM-side caller
asks :func:`quantreg.vllm.startup.mode_of`, which passes the shipped strictness in.

Also here (issue 24 class 5, tests by module): how each source asks for strict, from
test_containment_plugins.py (issue 12, plugin and start-up classes) (class 7: `strict: true` in a table
whose YAML is broken; QUANTREG_STRICT's values) and test_hardening.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from core_support import PluginSite, add, register_child, run_quantreg, write

from quantreg import Registry, settings
from quantreg.mode import decide_mode
from quantreg.vllm import multinode, startup

SHIPPED = "the driver that shipped this process its tables was strict"


def test_shipped_strictness_is_an_input_of_decide_mode() -> None:
    assert not decide_mode({}, ()).strict
    mode = decide_mode({}, (), shipped_strict=True)
    assert mode.strict and mode.because == (SHIPPED,)
    both = decide_mode({"QUANTREG_STRICT": "1"}, (), run_strict=True, shipped_strict=True)
    assert both.because == ("QUANTREG_STRICT=1", 'vLLM additional_config {"quantreg": {"strict": true}}', SHIPPED)


def test_a_worker_is_strict_when_its_driver_shipped_strict(table: Any, clean_env: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's registry is strict by its user table; the worker reads only the shipment."""
    user = table("strict.yaml", "version: 1\nstrict: true\nrules: []\n")
    driver_env = {"QUANTREG_CONFIG": str(user)}
    driver = Registry.build(env=driver_env, entry_points=False)
    assert driver.strict
    driver_env[settings.FINGERPRINT] = driver.fingerprint()
    shipment = multinode.publish(driver, driver_env)
    assert shipment is not None and shipment.strict
    worker = Registry.build(env={}, entry_points=False)
    assert not worker.mode().strict  # its own tables and environment say lenient
    monkeypatch.setenv(settings.TABLES, driver_env[settings.TABLES])
    mode = startup.mode_of(worker, None)
    assert mode.strict and SHIPPED in mode.because
    assert startup.mode_of(None, None).strict  # no registry at all: the shipment still counts
    monkeypatch.delenv(settings.TABLES)
    assert not startup.mode_of(worker, None).strict


# -- from test_containment_plugins.py (issue 12, plugin and start-up classes) -----------------


YAML_FAULTS: dict[str, bytes] = {
    "duplicate key": b"rules: []\nrules: []\n",
    "timestamp": b"rules: []\nwhen: 2024-01-01\n",
    "non-UTF-8 byte": b"rules: []\nnote: caf\xe9\n",
    "control character": b"rules: []\nnote: a\x07b\n",
    "syntax error": b"rules: [}\n",
}


def strict_broken(tmp_path: Path, kind: str, header: bytes = b"version: 1\nstrict: true\n") -> Path:
    return write(tmp_path / f"{kind.replace(' ', '_')}.yaml", header + YAML_FAULTS[kind])


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("order", ["broken first", "broken last"])
@pytest.mark.parametrize("kind", sorted(YAML_FAULTS))
def test_strict_is_honoured_whatever_the_yaml_fault_and_the_order(tmp_path: Path, kind: str, order: str) -> None:
    broken = strict_broken(tmp_path, kind)
    plain = write(tmp_path / "plain.yaml", "version: 1\nrules:\n  - {match: {device: cpu}, method: vllm}\n")
    paths = [broken, plain] if order == "broken first" else [plain, broken]
    registry = Registry.build(env={"QUANTREG_CONFIG": os.pathsep.join(map(str, paths)), "QUANTREG_PLUGINS": ""})
    assert [p.path for p in registry.problems] == [str(broken)]
    assert registry.mode().because == (f"strict: true in {broken}",)


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("kind", ["non-UTF-8 byte", "syntax error"])
def test_strict_broken_table_stops_register_and_the_cli(tmp_path: Path, kind: str) -> None:
    broken = strict_broken(tmp_path, kind)
    out, data = register_child(None, QUANTREG_CONFIG=str(broken))
    assert out.returncode == 3 and data["raised"] == "QuantregError" and str(broken) in data["message"]
    answer = run_quantreg("explain", "fp8", "llama", "cpu", QUANTREG_CONFIG=str(broken))
    assert answer.returncode == 1 and f"vLLM would refuse to start (strict: true in {broken}): " in answer.stderr


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("header", [b"version: 1\nstrict: false\n", b"version: 1\n  strict: true\n",
                                    b"version: 1\n# strict: true\n", b"version: 1\nnot_strict: true\n",
                                    b"version: 1\nstrict: yes\n"])
def test_only_a_top_level_strict_true_line_counts(tmp_path: Path, header: bytes) -> None:
    broken = strict_broken(tmp_path, "syntax error", header)
    registry = Registry.build(env={"QUANTREG_CONFIG": str(broken), "QUANTREG_PLUGINS": ""})
    assert registry.problems and not registry.mode().strict


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("line", [b"strict: true", b"strict:true  # ask", b"strict : TRUE\r", b"strict:\tTrue"])
def test_the_raw_strict_line_forms(tmp_path: Path, line: bytes) -> None:
    broken = write(tmp_path / "t.yaml", b"version: 1\n" + line + b"\nrules: [}\n")
    assert Registry.build(env={"QUANTREG_CONFIG": str(broken), "QUANTREG_PLUGINS": ""}).mode().strict


@pytest.mark.usefixtures("clean_env")
def test_a_plugin_table_cannot_ask_for_strict_even_through_raw_text(plugin_site: PluginSite) -> None:
    add(plugin_site, "stricty", """
import quantreg
from pathlib import Path

@quantreg.hookimpl
def register_tables(register):
    register(Path(__file__).with_name("stricty.yaml"))
""", **{"stricty.yaml": "version: 1\nstrict: true\nrules: [}\n"})
    registry = Registry.build(env={"QUANTREG_PLUGINS": "stricty"})
    assert registry.problems and not registry.mode().strict


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("raw,strict,problem", [
    ("1", True, False), (" TRUE ", True, False), ("yes", True, False), ("On", True, False),
    ("0", False, False), ("false", False, False), ("", False, False), ("off", False, False), ("No", False, False),
    ("2", True, True), ("maybe", True, True), ("strict", True, True)])
def test_quantreg_strict_values(raw: str, strict: bool, problem: bool) -> None:
    registry = Registry.build(env={"QUANTREG_STRICT": raw}, entry_points=False)
    assert registry.mode().strict is strict
    found = [str(p) for p in registry.problems]
    assert found == ([f"environment: QUANTREG_STRICT: {raw!r} is not one of 1, true, yes, on (strict) or "
                      "0, false, no, off (lenient); counted as strict"] if problem else [])


# -- from test_hardening.py (strict vs lenient, fault isolation, security) --------------------


@pytest.mark.usefixtures("clean_env")
def test_strict_true_in_a_broken_user_table_still_means_strict(tmp_path: Path) -> None:
    bad = tmp_path / "user.yaml"
    bad.write_text("version: 1\nstrict: true\nrules:\n  - match: {device: cpu}\n    method: nope\n")
    registry = Registry.build(env={"QUANTREG_CONFIG": str(bad)})
    assert registry.tables and all(t.path != str(bad) for t in registry.tables)  # the table itself is dropped
    assert registry.strict  # ... but its request for strict mode is not silently lost


@pytest.mark.usefixtures("clean_env")
def test_plugin_tables_cannot_switch_on_strict_mode(plugin_site: PluginSite) -> None:
    plugin_site.add("qrt-bossy", {"bossy": "qrt_bossy"}, modules={"qrt_bossy": """
import quantreg
from pathlib import Path

@quantreg.hookimpl
def register_tables(register):
    register(Path(__file__).with_name("qrt_bossy.yaml"))
"""}, files={"qrt_bossy.yaml": "version: 1\nstrict: true\nrules: []\n"})
    registry = Registry.build()
    assert any(t.strict for t in registry.tables)
    assert not registry.strict
