"""quantreg.methods: ``Method`` fields as plugins write them (``check_method``'s documented forms, devices
never matched as a substring), bounded probes (a hanging or raising probe, an infinite timeout) and a
target that does not exist failing at load, naming it.

History (issue 24 class 5): moved from tests/test_containment_plugins.py (issue 12, plugin and start-up
classes) (classes 5, 8) and tests/test_hardening.py (strict vs lenient, plugin fault isolation,
security).
"""

from __future__ import annotations

import math
import threading
import time

import pytest
from core_support import PluginSite, _Registers

import quantreg
from quantreg import Registry, settings
from quantreg.methods import check_method, run_probe

pytestmark = pytest.mark.usefixtures("clean_env")


# -- from test_containment_plugins.py (issue 12, plugin and start-up classes) -----------------


def test_devices_as_a_string_never_matches_a_substring() -> None:
    registry = Registry.build(env={}, entry_points=False, plugins=[("p", _Registers(
        quantreg.Method(name="h", target="qrt_x:Y", devices="hpu")))])  # type: ignore[arg-type]
    assert "h" not in registry.methods and registry.availability("h", "pu").ok is False


def test_check_method_accepts_the_documented_forms() -> None:
    ok = quantreg.Method(name="m", target="pkg.mod:Cls.inner", devices=["cpu", "hpu"], requires=("a.b",),
                         vllm_version=">=0.30", probe="pkg.probe:check", options=["chunk"], description="d")
    assert check_method(ok) is None
    assert check_method(quantreg.Method(name="m", target="p:C", probe=lambda: (True, "ok"), vllm_version="")) is None


def test_an_infinite_timeout_does_not_overflow_in_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTREG_PROBE_TIMEOUT", "inf")
    assert settings.value(settings.PROBE_TIMEOUT) == threading.TIMEOUT_MAX
    probed = quantreg.Method(name="probed", target="qrt_x:Y", probe=lambda: (True, "here"))
    registry = Registry.build(env={"QUANTREG_PROBE_TIMEOUT": "inf"}, entry_points=False,
                              plugins=[("p", _Registers(probed))])
    assert registry.availability("probed", "cpu").ok and registry.faults == ()
    assert run_probe(lambda: (True, "fast"), math.inf).ok  # callers passing inf directly are clamped too


# -- from test_hardening.py (strict vs lenient, fault isolation, security) --------------------


def test_hanging_probe_is_bounded(plugin_site: PluginSite, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin_site.add("qrt-slow", {"slow": "qrt_slow"}, modules={"qrt_slow": """
import time
import quantreg

def hang():
    time.sleep(30)
    return True, "never reached"

def boom():
    raise OSError("driver not loaded")

@quantreg.hookimpl
def register_methods(register):
    register(quantreg.Method(name="slow", target="qrt_slow:X", probe="qrt_slow:hang"))
    register(quantreg.Method(name="boom", target="qrt_slow:X", probe="qrt_slow:boom"))
"""})
    monkeypatch.setenv("QUANTREG_PROBE_TIMEOUT", "0.3")
    registry = Registry.build()
    start = time.monotonic()
    slow = registry.availability("slow", "cpu")
    assert time.monotonic() - start < 5
    assert not slow.ok and "did not answer within 0.3s" in slow.reason
    boom = registry.availability("boom", "cpu")
    assert not boom.ok and boom.reason == "probe raised OSError: driver not loaded"


def test_nonexistent_target_fails_at_load_naming_it(plugin_site: PluginSite) -> None:
    plugin_site.add("qrt-ghost", {"ghost": "qrt_ghost"}, modules={"qrt_ghost": """
import quantreg

@quantreg.hookimpl
def register_methods(register):
    register(quantreg.Method(name="ghost", target="qrt_ghost:Missing"))
"""})
    registry = Registry.build()
    with pytest.raises(ImportError, match="module 'qrt_ghost' has no attribute 'Missing'"):
        registry.methods["ghost"].load()
