"""The kit's packaging checks (quantreg.testing.packaging) against real entry points and real setup.py runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import quantreg.builtin
from quantreg.testing.packaging import build_without_compiler, installed_entry_point


def test_an_installed_entry_point_passes_and_a_wrong_one_is_named() -> None:
    hpu = pytest.importorskip("quantreg_hpu_mxfp4.plugin", reason="plugin #1 is not installed")
    assert installed_entry_point("hpu_mxfp4", hpu, "quantreg-hpu-mxfp4").value == "quantreg_hpu_mxfp4.plugin"
    with pytest.raises(AssertionError, match="found 0"):
        installed_entry_point("no_such_plugin", hpu, "quantreg-hpu-mxfp4")
    with pytest.raises(AssertionError, match=re.escape("names 'quantreg_hpu_mxfp4.plugin', not 'quantreg.builtin'")):
        installed_entry_point("hpu_mxfp4", quantreg.builtin, "quantreg-hpu-mxfp4")
    with pytest.raises(AssertionError, match="installed by 'quantreg-hpu-mxfp4', not 'someone-else'"):
        installed_entry_point("hpu_mxfp4", hpu, "someone-else")


def _setup(root: Path, body: str) -> Path:
    root.mkdir()
    (root / "setup.py").write_text(body)
    return root


@pytest.mark.parametrize("body,expected", [
    ("print('demo: compiled kernel NOT built (no compiler)')\n", None),
    ("print('all fine')\n", "expected one line 'demo: compiled kernel NOT built"),
    ("print('demo: compiled kernel NOT built (a)')\nprint('demo: compiled kernel NOT built (b)')\n",
     "expected one line"),
    ("import sys; print('demo: compiled kernel NOT built (x)'); sys.exit(3)\n", "exit 3"),
    ("print('demo: compiled kernel NOT built (x)')\ntry:\n    1/0\nexcept Exception:\n"
     "    import traceback; traceback.print_exc()\n", "Traceback"),
])
def test_build_without_compiler_runs_the_real_setup_and_checks_its_one_line(tmp_path: Path, body: str,
                                                                            expected: str | None) -> None:
    """A stand-in setup.py (any script run as ``python setup.py -q build_ext --inplace``) shows each verdict;
    the two plugins' own tests run it on their real setup.py."""
    root = _setup(tmp_path / "demo", "import os, sys\nassert os.environ['CXX'] == '/bin/false', os.environ\n"
                  "assert sys.argv[1:] == ['-q', 'build_ext', '--inplace'], sys.argv\n" + body)
    if expected is None:
        assert "NOT built (no compiler)" in build_without_compiler(root, "demo")
    else:
        with pytest.raises(AssertionError, match=re.escape(expected)):
            build_without_compiler(root, "demo")
