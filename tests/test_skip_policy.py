"""Skips only for what is absent (issue 31.4): the rule tests/conftest.py applies to every skip."""

from __future__ import annotations

import pytest
from core_support import FULL_ENV, skip_verdict


def test_a_missing_top_level_package_is_a_skip() -> None:
    assert skip_verdict("could not import 'qrt_surely_absent_package': No module named 'qrt_surely_absent_package'",
                        {}) is None
    assert skip_verdict("needs torch (not installed)", {}) is None


def test_a_missing_submodule_of_an_installed_package_fails() -> None:
    verdict = skip_verdict("could not import 'json.moved_away': No module named 'json.moved_away'", {})
    assert verdict is not None and "json.moved_away cannot be imported although json is installed" in verdict


def test_the_full_environment_fails_on_any_skip_for_an_absent_stack() -> None:
    full = {FULL_ENV: "1"}
    assert skip_verdict("needs vLLM (not installed): marked vllm", full) is not None
    assert skip_verdict("could not import 'qrt_surely_absent_package'", full) is not None
    # a skip for what this host cannot show stands everywhere
    assert skip_verdict("needs real AMX hardware; this host: kind avx512, no amx_tile", full) is None
    assert skip_verdict("no FIFOs on this platform", full) is None


def test_the_conftest_turns_only_absent_top_level_packages_into_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    from pathlib import Path

    # tests/conftest.py itself (a plugin's tests/conftest.py may be the module named conftest in this run)
    spec = importlib.util.spec_from_file_location("quantreg_tests_conftest", Path(__file__).with_name("conftest.py"))
    assert spec is not None and spec.loader is not None
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)

    monkeypatch.setattr(conftest, "OPTIONAL", ("json", "qrt_surely_absent_package"))
    gone = "qrt_surely_absent_package.sub"
    absent = ModuleNotFoundError(f"No module named '{gone}'", name=gone)
    moved = ModuleNotFoundError("No module named 'json.moved_away'", name="json.moved_away")
    assert conftest._missing_optional(absent) == "qrt_surely_absent_package"
    assert conftest._missing_optional(moved) is None
    assert conftest._missing_optional(RuntimeError("x")) is None
