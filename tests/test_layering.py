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


# -- the import graph: no circles, arrows only downwards (issue 24) ------------------------------

#: Floors, lowest first: a module may import (at module level) only from its own floor or below.
#: ``core`` is the deciding core, the plugin API and the table pipeline; ``vllm`` the start-up hook
#: and seam; ``kit`` the conformance kit that builds vLLM layers; ``tools`` the commands.
FLOORS = ("core", "vllm", "kit", "tools")
TOOLS = ("quantreg.cli", "quantreg.__main__", "quantreg.plan", "quantreg.demo", "quantreg.tune", "quantreg.newplugin")
#: Documented arrows that run back up (docs/design.md, "Arrows that run up"): (from, to).
UPWARD_ALLOWED: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def floor_of(module: str) -> int:
    if module in TOOLS or any(module.startswith(t + ".") for t in TOOLS):
        return FLOORS.index("tools")
    if module == "quantreg.testing" or module.startswith("quantreg.testing."):
        return FLOORS.index("kit")
    if module == "quantreg.vllm" or module.startswith("quantreg.vllm."):
        return FLOORS.index("vllm")
    return FLOORS.index("core")


def _type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def module_level_imports(path: Path, modules: set[str]) -> set[str]:
    """quantreg modules ``path`` imports when it is imported: top-level statements (and ``try`` bodies),
    ``if TYPE_CHECKING:`` blocks and imports inside functions excluded."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()
    stack = [n for n in ast.parse(path.read_text(encoding="utf-8"), str(path)).body if not _type_checking(n)]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Try):
            stack += node.body
        elif isinstance(node, ast.If):
            stack += node.body + node.orelse
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    return {m for m in found if m in modules and m != this}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: module_level_imports(p, set(paths)) for m, p in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_among_quantregs_modules() -> None:
    graph = import_graph()
    assert sum(len(v) for v in graph.values()) > 50  # the graph is really read (not vacuous)
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_arrows_run_only_downwards_except_the_documented_ones() -> None:
    graph = import_graph()
    upward = {(m, t) for m, targets in graph.items() for t in targets if floor_of(t) > floor_of(m)}
    assert upward <= UPWARD_ALLOWED, sorted(upward - UPWARD_ALLOWED)
    design = (PACKAGE.parent / "docs" / "design.md").read_text(encoding="utf-8")
    for source, target in UPWARD_ALLOWED:
        assert f"{source} -> {target}" in design, f"docs/design.md does not explain {source} -> {target}"


def test_the_module_map_in_design_md_lists_every_module_and_nothing_else() -> None:
    design = (PACKAGE.parent / "docs" / "design.md").read_text(encoding="utf-8")
    block = design.split("## Modules\n", 1)[1].split("```\n", 2)[1]
    mapped = {line.split()[0] for line in block.splitlines() if line.startswith("quantreg/")}
    actual = {str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")}
    assert len(actual) > 40
    assert sorted(actual - mapped) == [] and sorted(mapped - actual) == []
