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


# -- the import graph: no circles, arrows only downwards (issues 24, 31) -------------------------
# Every import counts: module-level, inside functions and under ``if TYPE_CHECKING:``. A lazy import
# is still a dependency (the module cannot work without the other), and a test that counted only
# module-level imports stayed green while 94 lazy edges closed a 13-file circle (issue 31).

#: Wings, lowest first: a module may import only from its own wing or below. ``core`` is the deciding
#: core, the plugin API and the table pipeline; ``vllm`` the start-up hook and seam; ``kit`` the
#: conformance kit that builds vLLM layers; ``tools`` the commands.
FLOORS = ("core", "vllm", "kit", "tools")
TOOLS = ("quantreg.cli", "quantreg.commands", "quantreg.__main__", "quantreg.doctor", "quantreg.output",
         "quantreg.plan", "quantreg.demo", "quantreg.tune", "quantreg.newplugin")
#: The core's own floors, lowest first (docs/design.md's module map lists the core in this order): a
#: core module imports only from lower floors (or its own, without a circle). Lowest: values that
#: need nothing; then the host and the one caller of plugin code (``hookcall``), which every module
#: running plugin code (a probe, an ``applies`` check, a hook) calls *down* into; then methods; table
#: parts; a table file; decisions; what plugins say; the hook specs; the built-in plugin; the loader
#: of plugins; the load loop; the registry; the answers; the public API.
CORE_FLOORS: tuple[tuple[str, ...], ...] = (
    ("quantreg.bounds", "quantreg.error_measure", "quantreg.files", "quantreg.formats", "quantreg.jsonread",
     "quantreg.keys",
     "quantreg.models", "quantreg.models.gpt_oss", "quantreg.models.moe_config", "quantreg.problems",
     "quantreg.settings", "quantreg.table", "quantreg.tiny", "quantreg.version_spec"),
    ("quantreg.formats.mxfp4_compiled", "quantreg.hookcall", "quantreg.host", "quantreg.installed",
     "quantreg.models.checkpoint", "quantreg.native", "quantreg.records",
     "quantreg.table.located", "quantreg.tiny.tokenizer", "quantreg.writing"),
    ("quantreg.formats.mxfp4", "quantreg.methods", "quantreg.models.checkpoint_files", "quantreg.table.identity",
     "quantreg.table.yamlfile", "quantreg.vllm_limits"),
    ("quantreg.models.gpt_oss_moe", "quantreg.pins", "quantreg.table.cache", "quantreg.table.methods",
     "quantreg.table.match", "quantreg.table.rules", "quantreg.table.tuned", "quantreg.table.verify",
     "quantreg.tiny.checkpoint", "quantreg.tiny.planted"),
    ("quantreg.table.file",),
    ("quantreg.decision", "quantreg.index", "quantreg.mode", "quantreg.table.schema"),
    ("quantreg.audit", "quantreg.findings", "quantreg.keepers"),
    ("quantreg.hookspecs",),
    ("quantreg.builtin",),
    ("quantreg.plugins",),
    ("quantreg.loading",),
    ("quantreg.registry",),
    ("quantreg.answer", "quantreg.envelope"),
    ("quantreg", "quantreg.tiny.command"),
)
#: Documented arrows that run back up (docs/design.md, "Arrows that run up"): (from, to). None: the last
#: one, ``quantreg.methods -> quantreg.vllm.platform`` (``Method.load`` fetched vLLM's base classes),
#: went when the callers that build for vLLM began passing the base into ``Method.build`` (issue 47).
UPWARD_ALLOWED: set[tuple[str, str]] = set()
#: The numbers docs/design.md states: circles in quantreg/ and in each plugin, arrows that run up.
CIRCLES = 0
UPWARD = len(UPWARD_ALLOWED)
#: Every plugin's package (plugins/*/quantreg_*), found rather than listed: a new plugin is held too.
PLUGINS = {p.parent.name: p.parent for p in sorted((PACKAGE.parent / "plugins").glob("*/quantreg_*/__init__.py"))}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
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


def every_import(path: Path, modules: set[str], root: Path = PACKAGE) -> set[str]:
    """The package's modules ``path`` imports anywhere: top level, in functions, under TYPE_CHECKING."""
    this = module_name(path, root)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
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


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    return {m: every_import(p, set(paths), root) for m, p in paths.items()}


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


def test_the_graph_counts_lazy_and_type_checking_imports() -> None:
    """Not vacuous: the edges only a function body or a TYPE_CHECKING block makes are in the graph."""
    graph = import_graph()
    assert sum(len(v) for v in graph.values()) > 300
    assert "quantreg.hookcall" in graph["quantreg.methods"]  # inside run_probe
    assert "quantreg.decision" in graph["quantreg.hookspecs"]  # under TYPE_CHECKING


def test_no_import_circles_in_quantreg() -> None:
    assert len(cycles(import_graph())) == CIRCLES, cycles(import_graph())


def test_no_import_circles_in_each_plugin() -> None:
    assert len(PLUGINS) >= 4, sorted(PLUGINS)  # hpu_mxfp4, cpu_mxfp4, cpu_int8_dense, cpu_bf16_dense
    for name, root in PLUGINS.items():
        graph = import_graph(root)
        assert len(graph) > 3, name
        assert len(cycles(graph)) == CIRCLES, (name, cycles(graph))


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_arrows_run_only_downwards_except_the_documented_ones() -> None:
    graph = import_graph()
    upward = {(m, t) for m, targets in graph.items() for t in targets if floor_of(t) > floor_of(m)}
    core = {m: i for i, floor in enumerate(CORE_FLOORS) for m in floor}
    upward |= {(m, t) for m, targets in graph.items() if m in core for t in targets if core.get(t, -1) > core[m]}
    assert upward == UPWARD_ALLOWED and len(upward) == UPWARD, sorted(upward ^ UPWARD_ALLOWED)
    design = (PACKAGE.parent / "docs" / "design.md").read_text(encoding="utf-8")
    for source, target in UPWARD_ALLOWED:
        assert f"{source} -> {target}" in design, f"docs/design.md does not explain {source} -> {target}"


def test_every_core_module_has_one_floor() -> None:
    core = sorted(m for m in import_graph() if floor_of(m) == FLOORS.index("core"))
    listed = [m for floor in CORE_FLOORS for m in floor]
    assert sorted(listed) == core


def test_design_md_states_the_numbers_this_test_holds() -> None:
    design = (PACKAGE.parent / "docs" / "design.md").read_text(encoding="utf-8")
    assert f"{CIRCLES} circles in `quantreg/` and in each plugin" in design
    assert f"{UPWARD} imports that run up" in design
    assert f"{len(CORE_FLOORS)} floors" in design


def test_the_module_map_in_design_md_lists_every_module_and_nothing_else() -> None:
    design = (PACKAGE.parent / "docs" / "design.md").read_text(encoding="utf-8")
    block = design.split("## Modules\n", 1)[1].split("```\n", 2)[1]
    mapped = {line.split()[0] for line in block.splitlines() if line.startswith("quantreg/")}
    actual = {str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")}
    assert len(actual) > 40
    assert sorted(actual - mapped) == [] and sorted(mapped - actual) == []
    # ... in floor order: the wings, and the core's floors, lowest first
    core = {m: i for i, floor in enumerate(CORE_FLOORS) for m in floor}
    order = []
    for line in block.splitlines():
        if line.startswith("quantreg/") and line.split()[0] != "quantreg/__main__.py":
            module = module_name(PACKAGE.parent / line.split()[0])
            order.append((floor_of(module), core.get(module, 0)))
    assert order == sorted(order)


# -- test files you can find (issue 31.8) --------------------------------------------------------

#: ``tests/test_<module path>[_<topic>].py``: the module path of what it tests, under ``quantreg/``,
#: with ``_`` for ``/`` (``test_table_file.py`` for quantreg/table/file.py, ``test_vllm_coverage.py``
#: for quantreg/vllm/coverage.py), optionally followed by a topic. Tests of a property of the whole
#: project, not of one module, are named by the property and listed here. (tests/e2e/ holds the
#: real-vLLM scenarios, named by scenario.)
WHOLE_PROJECT_TESTS = ("bad_tables", "core_names", "doc_links", "escaping", "exports", "fingerprint_content",
                       "bench_arguments", "hook_docs", "layering", "messages", "no_torch", "one_pass", "plugin_imports",
                       "registered_fields", "skip_policy", "validate_limits")


def test_test_files_are_named_for_the_module_they_test() -> None:
    modules = {module_name(p).removeprefix("quantreg").lstrip(".").replace(".", "_")
               for p in PACKAGE.rglob("*.py")} - {""}
    tests = sorted(p.stem.removeprefix("test_") for p in (PACKAGE.parent / "tests").glob("test_*.py"))
    assert len(tests) > 50
    unnamed = [t for t in tests if t not in WHOLE_PROJECT_TESTS
               and not any(t == m or t.startswith(m + "_") for m in modules)]
    assert unnamed == [], "name them test_<module path>[_<topic>].py, or list a whole-project property"


def test_no_two_test_files_share_a_basename() -> None:
    """The test directories are not packages: pytest imports each file under its basename, so a second
    ``test_x.py`` anywhere (tests/, tests/e2e/, a plugin's tests/) stops the whole collection with
    "import file mismatch". Scenario files in tests/e2e/ take a suffix (``test_tune_crossover_vllm.py``)."""
    root = PACKAGE.parent
    files = [*(root / "tests").rglob("test_*.py"), *(root / "plugins").glob("*/tests/**/test_*.py")]
    seen: dict[str, list[str]] = {}
    for path in files:
        seen.setdefault(path.name, []).append(str(path.relative_to(root)))
    assert len(files) > 80
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


# -- the picture is true (issue 31.8) -------------------------------------------------------------

def _resolve(dotted: str) -> object:
    """``quantreg.<dotted>``: the longest module prefix imported, the rest read as attributes; a
    leading class name (``Registry.resolve``) is read from the public API."""
    import importlib

    import quantreg

    parts = dotted.split(".")
    obj: object = quantreg
    start = 0
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module("quantreg." + ".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        start = cut
        break
    for part in parts[start:]:
        obj = getattr(obj, part)
    return obj


def test_the_diagram_in_design_md_names_only_what_exists() -> None:
    """Every ``name()`` and ``module.name`` the decision diagram draws is a real function, method or
    value under that name (a renamed or moved function makes the picture lie)."""
    import re

    design = (PACKAGE.parent / "docs" / "design.md").read_text(encoding="utf-8")
    block = design.split("## One decision, followed through the code\n", 1)[1].split("```\n", 2)[1]
    names = set(re.findall(r"\b((?:[a-z_]+|[A-Z][A-Za-z]+)(?:\.[A-Za-z_]+)+)(?=\(\)|\b)", block))
    names -= {"registry.yaml"}  # a file, not a name
    names -= {"RoutedExperts._get_quant_method"}  # vLLM's (scripts/vllm_compat_check.py checks it in each release)
    assert len(names) >= 15, sorted(names)
    missing = []
    for name in sorted(names):
        try:
            _resolve(name)
        except AttributeError:
            missing.append(name)
    assert missing == []
