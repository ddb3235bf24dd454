"""Tables written before the ``tokens`` match key (issue 32) keep their decisions AND their fingerprints.

The same snapshot as :mod:`test_keys_layer_compat` (every table of the repository in the run tier,
its methods registered by an in-test plugin, the fingerprint, the rules' JSON and the decision for
every key the tables name), taken with the CPU flags fixed to ``avx2,fma`` (host-aware chains then
decide the same on every host). ``tests/data/tokens_key_golden.json`` is that snapshot on the code
just before ``tokens`` existed (main at e213177), written by ``python tests/test_keys_tokens_compat.py
--write OLD_TREE`` with that tree first on ``sys.path`` (``git archive e213177 quantreg registry.yaml
plugins docs/examples tests | tar -x -C OLD_TREE``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_keys_layer_compat import ROOT, TABLES, normalised, snapshot

GOLDEN = Path(__file__).resolve().parent / "data" / "tokens_key_golden.json"
FLAGS = "avx2,fma"


def test_tables_without_tokens_keep_decisions_and_fingerprints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTREG_HOST_CPU_FLAGS", FLAGS)
    golden = json.loads(GOLDEN.read_text())
    now = normalised(snapshot(ROOT), ROOT)
    assert sorted(now) == sorted(golden) == sorted(TABLES)
    for rel in TABLES:
        assert "tokens" not in (ROOT / rel).read_text(encoding="utf-8"), rel  # what the golden is about
        assert now[rel]["fingerprint"] == golden[rel]["fingerprint"], rel
        assert now[rel]["rules"] == golden[rel]["rules"], rel
        assert now[rel]["decisions"] == golden[rel]["decisions"], rel
        assert len(golden[rel]["decisions"]) >= 8


if __name__ == "__main__":  # the golden file's writer (see the module docstring)
    if sys.argv[1:2] == ["--write"]:
        old = Path(sys.argv[2]).resolve()
        os.environ["QUANTREG_HOST_CPU_FLAGS"] = FLAGS
        for name in [m for m in sys.modules if m == "quantreg" or m.startswith("quantreg.")]:
            del sys.modules[name]
        sys.path.insert(0, str(old))
        GOLDEN.write_text(json.dumps(normalised(snapshot(old), old), indent=1, sort_keys=True) + "\n")
