"""``doctor``'s word on vLLM's default mode per method: the kit's last ``compiled`` verdict, for this build only.

A real module on disk stands for a method's target: the record is kept under the cache directory,
read back while the module's source is unchanged, and reads "not checked" once it changes (a new
build) or when caching is off; garbage is an "unreadable record". No torch, no vLLM.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from quantreg.methods import Method
from quantreg.testing.compiled_record import doctor_line, record, recorded


@pytest.fixture
def method(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Method:
    (tmp_path / "qrt_compiled_mod.py").write_text("class M:\n    pass\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("QUANTREG_CACHE_DIR", str(tmp_path / "cache"))
    sys.modules.pop("qrt_compiled_mod", None)
    return Method(name="qrt_compiled", target="qrt_compiled_mod:M", devices=("cpu",))


def test_a_verdict_is_read_back_for_the_same_build(method: Method) -> None:
    assert recorded(method)["status"] == "not checked"
    assert "run `quantreg check-method qrt_compiled`" in doctor_line(method, recorded(method))
    record(method, "FAIL", "torch.compile(fullgraph=True) of apply failed at 1 token(s) at x.py:3 (in apply)")
    seen = recorded(method)
    assert seen["status"] == "FAIL" and "x.py:3" in seen["detail"]
    line = doctor_line(method, seen)
    assert line.startswith("compiled:  qrt_compiled: no: torch.compile") and "behind its own op" in line
    record(method, "PASS", "equals eager")
    assert doctor_line(method, recorded(method)).startswith("compiled:  qrt_compiled: yes (")


def test_a_new_build_is_not_checked(method: Method, tmp_path: Path) -> None:
    record(method, "PASS", "equals eager")
    (tmp_path / "qrt_compiled_mod.py").write_text("class M:\n    x = 1\n", encoding="utf-8")
    assert recorded(method)["status"] == "not checked"


def test_garbage_is_an_unreadable_record_and_no_cache_is_not_checked(method: Method, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Garbage is not a verdict and not silence either: a located fault (test_records_untrusted.py walks the rest)."""
    record(method, "PASS", "equals eager")
    (tmp_path / "cache" / "compiled" / "qrt_compiled.json").write_text("{not json", encoding="utf-8")
    seen = recorded(method)
    assert seen["status"] == "unreadable record" and "qrt_compiled.json: not strict JSON" in seen["detail"]
    monkeypatch.setenv("QUANTREG_CACHE_DIR", "off")
    record(method, "PASS", "equals eager")  # nothing written, nothing raised
    assert recorded(method)["status"] == "not checked"
