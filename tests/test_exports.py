"""Every type a plugin constructs or is handed is exported from ``quantreg`` (issue 24.2), and the
docs teach ``quantreg.X``: plugins import from the package, so its modules can move."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import quantreg

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_TYPES = ("Method", "Key", "Decision", "BuildContext", "Availability", "Finding", "QuantConfigKeeper",
                "VllmLimitation", "keeps_quant_config")


def test_plugin_facing_types_are_exported_and_the_docs_list_them() -> None:
    docs = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    sentence = docs.split("imported from `quantreg` itself", 1)[1].split("Hooks receive", 1)[0]
    taught = set(re.findall(r"`quantreg\.(\w+)`", sentence))
    assert taught - {"__all__"} == set(PLUGIN_TYPES)  # "(a test holds this list to `quantreg.__all__`)"
    for name in PLUGIN_TYPES:
        assert name in quantreg.__all__, name
        assert getattr(quantreg, name) is not None
    assert "from quantreg.findings" not in docs and "from quantreg.keepers" not in docs
    assert "from quantreg.vllm_limits" not in docs


def test_lazy_exports_cost_nothing_until_used() -> None:
    code = ("import sys, quantreg; lazy = ('quantreg.findings', 'quantreg.answer', 'quantreg.vllm_limits');"
            "print(any(m in sys.modules for m in lazy)); from quantreg import Finding; "
            "print('quantreg.findings' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "True"], out.stderr


def test_plugin_one_imports_its_types_from_quantreg() -> None:
    source = "\n".join(p.read_text(encoding="utf-8") for p in
                       (ROOT / "plugins" / "hpu_mxfp4" / "quantreg_hpu_mxfp4").glob("*.py"))
    assert re.findall(r"from quantreg\.(findings|keepers|vllm_limits|keys) import", source) == []
