"""Every problem of a table in one pass, sorted by line (issue 22 class 6).

Before: a bad sibling key (a typo'd key, a wrong type) left the file out before the checks that need
the registered methods ran, so an unknown method name or ``verify.against`` surfaced only on the next
run, after the first typo was fixed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from core_support import run_cli

from quantreg.loading import load_tables
from quantreg.registry import Registry
from quantreg.table.file import Tier

ENV = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
TABLE = """\
version: 1
rules:
  - match: {quant_format: fp8, devce: cpu}
    method: vlm
  - match: {quant_format: fp8, device: hpu}
    method: vllm
    priorty: 2
    verify: {against: flot64}
  - match: {quant_format: fp9, device: cpu}
    method: [vllm, no_such_method]
    priority: high
"""


def test_three_typos_and_their_references_in_one_run(tmp_path: Path) -> None:
    path = tmp_path / "typos.yaml"
    path.write_text(TABLE)
    out = run_cli("validate", "--json", str(path), env={**ENV, "QUANTREG_PLUGINS": ""})
    assert out.returncode == 1, out.stderr
    problems = json.loads(out.stdout)["problems"]
    found = [(p["line"], p["key"]) for p in problems]
    assert found == sorted(found, key=lambda f: f[0])  # sorted by line
    assert found == [(3, "rules[0].match.devce"), (4, "rules[0].method"), (7, "rules[1].priorty"),
                     (8, "rules[1].verify"),  # verify: on a `vllm` rule can never run (issue 21 class 11)
                     (8, "rules[1].verify.against"), (10, "rules[2].method"), (11, "rules[2].priority")], problems
    assert "did you mean 'vllm'?" in problems[1]["message"]


def test_a_table_methods_entry_counts_for_its_own_rules(tmp_path: Path) -> None:
    """A left-out table's own ``methods:`` are known to its reference check (no false 'unknown')."""
    path = tmp_path / "own.yaml"
    path.write_text("version: 1\nallow_import_targets: true\nmethods:\n  mine: {target: 'x.y:Z'}\nrules:\n"
                    "  - match: {quant_format: fp8}\n    method: mine\n    priority: nope\n")
    registry = Registry.build(config=())
    _, _, problems = load_tables([(str(path), Tier.USER)], registry.methods)
    assert [(p.line, p.key) for p in problems] == [(8, "rules[0].priority")], problems
