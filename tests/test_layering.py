"""Where vLLM may be imported (issue 11): only ``quantreg/vllm/`` and the kit that builds vLLM layers
on purpose (``quantreg/testing/``). Everything else reaches vLLM through ``quantreg.vllm`` functions,
lazily, so the core stays importable (and fast) on hosts without vLLM or with vLLM not yet loaded."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "quantreg"
ALLOWED = ("vllm", "testing")


def _vllm_imports(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import) and any(a.name == "vllm" or a.name.startswith("vllm.") for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None and (
                node.module == "vllm" or node.module.startswith("vllm.")):
            lines.append(node.lineno)
    return lines


def test_vllm_is_imported_only_under_quantreg_vllm_and_the_kit() -> None:
    offenders = []
    seen = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        inside = rel.parts[0] in ALLOWED
        found = _vllm_imports(path)
        seen += bool(found)
        if found and not inside:
            offenders.append(f"{rel}:{found[0]}")
    assert offenders == []
    assert seen >= 3  # the check itself sees imports (quantreg/vllm/*, the harness): it is not vacuous
