"""Plugins import only quantreg's documented public names (issue 31.7).

``quantreg/__init__.py`` says plugins import its public types from ``quantreg``, never from its
modules (so modules can move); both plugins imported ``quantreg.methods.BuildContext``. Here every
import of a quantreg module in the plugins' packages (module level, in functions, under
TYPE_CHECKING) must be ``from quantreg import <a name in quantreg.__all__>`` or come from a module
docs/plugins.md lists as public.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import quantreg

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in ROOT.glob("plugins/*/quantreg_*/__init__.py"))


def documented_modules() -> set[str]:
    text = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    block = text.split("<!-- public modules -->", 1)[1].split("<!-- end public modules -->", 1)[0]
    return set(re.findall(r"`(quantreg(?:\.[a-z_0-9]+)+)`", block))


def quantreg_imports(path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "quantreg":
            found.append((node.lineno, node.module, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, ()) for a in node.names if a.name.split(".")[0] == "quantreg"]
    return found


def test_plugins_import_only_documented_public_names() -> None:
    public = documented_modules()
    assert "quantreg.vllm.routing" in public  # the docs' list is really read
    offenders = []
    seen = 0
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            for line, module, names in quantreg_imports(path):
                seen += 1
                where = f"{path.relative_to(ROOT)}:{line}"
                if module == "quantreg":
                    offenders += [f"{where}: quantreg.{n} is not in quantreg.__all__"
                                  for n in names if n not in quantreg.__all__]
                elif module not in public and not (names and all(f"{module}.{n}" in public for n in names)):
                    offenders.append(f"{where}: {module} is not a documented public module (docs/plugins.md)")
                else:
                    offenders += [f"{where}: import {n} from quantreg, not from {module}"
                                  for n in names if n in quantreg.__all__]
    assert len(PACKAGES) == 4 and seen > 20  # hpu_mxfp4, cpu_mxfp4, cpu_int8_dense, cpu_bf16_dense
    assert offenders == []
