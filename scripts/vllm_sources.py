"""Reading a vLLM release's sources without importing them, for scripts/vllm_compat_check.py.

:class:`Sources` is the ``vllm`` package of a wheel (read as a zip, members parsed in memory) or a
directory; :class:`Resolver` finds where ``module.name`` is defined, following re-exports, vLLM's
lazy module attributes and base classes. Nothing is imported, so a CUDA-only release is read on a
CPU machine.
"""

from __future__ import annotations

import ast
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class Sources:
    """The ``vllm`` package of a wheel or a directory: module name -> (path, parsed AST)."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self._zip: zipfile.ZipFile | None = None
        self._files: dict[str, str] = {}  # relative posix path ("vllm/x/y.py") -> location label
        self._root: Path | None = None
        self._cache: dict[str, ast.Module | None] = {}
        if target.is_file() and target.suffix == ".whl":
            self._zip = zipfile.ZipFile(target)
            for name in self._zip.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    self._files[name] = name
        elif target.is_dir():
            root = target.parent if (target / "__init__.py").exists() and target.name == "vllm" else target
            if not (root / "vllm" / "__init__.py").exists():
                raise SystemExit(f"vllm_compat_check: {target}: no vllm/__init__.py here (expected a .whl, "
                                 "a directory containing the vllm package, or the package directory itself)")
            self._root = root
            for path in (root / "vllm").rglob("*.py"):
                self._files[path.relative_to(root).as_posix()] = str(path)
        else:
            raise SystemExit(f"vllm_compat_check: {target}: not a .whl file or a directory")

    def read(self, rel: str) -> str:
        if self._zip is not None:
            return self._zip.read(rel).decode("utf-8", errors="replace")
        assert self._root is not None
        return (self._root / rel).read_text(encoding="utf-8", errors="replace")

    def module_file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for rel in (base + ".py", base + "/__init__.py"):
            if rel in self._files:
                return rel
        return None

    def parse(self, module: str) -> ast.Module | None:
        if module not in self._cache:
            rel = self.module_file(module)
            try:
                self._cache[module] = ast.parse(self.read(rel), rel) if rel else None
            except SyntaxError:
                self._cache[module] = None
        return self._cache[module]

    def files(self) -> Iterator[str]:
        yield from sorted(self._files)

    def version(self) -> str | None:
        """The release, from the wheel's METADATA, a sibling dist-info, or vllm/_version.py."""
        pattern = re.compile(r"^Version:\s*(\S+)", re.M)
        if self._zip is not None:
            for name in self._zip.namelist():
                if name.endswith(".dist-info/METADATA"):
                    match = pattern.search(self._zip.read(name).decode("utf-8", errors="replace"))
                    if match:
                        return match.group(1)
        if self._root is not None:
            for meta in sorted(self._root.glob("vllm*.dist-info/METADATA")):
                match = pattern.search(meta.read_text(errors="replace"))
                if match:
                    return match.group(1)
        for rel in ("vllm/_version.py", "vllm/version.py"):
            if rel in self._files:
                match = re.search(r"""(?:__version__|version)\s*(?::\s*str\s*)?=\s*['"]([^'"]+)['"]""", self.read(rel))
                if match:
                    return match.group(1)
        return None


@dataclass
class Found:
    module: str
    node: ast.AST | None  # None: a module, or a name only known lazily


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module statements, looking into top-level if/try blocks (version and TYPE_CHECKING guards)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body)
            for handler in node.handlers:
                yield from _top_level(handler.body)
            yield from _top_level(node.orelse)
        else:
            yield node


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, target] if target else base)


class Resolver:
    def __init__(self, sources: Sources) -> None:
        self.src = sources

    def is_package(self, module: str) -> bool:
        rel = self.src.module_file(module)
        return rel is not None and rel.endswith("/__init__.py")

    def find(self, module: str, name: str, depth: int = 0) -> Found | None:
        """Where ``module.name`` is defined, following re-exports and vLLM's lazy module attributes."""
        if depth > 8:
            return None
        tree = self.src.parse(module)
        if tree is None:
            return None
        pkg = self.is_package(module)
        for node in _top_level(tree.body):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
                return Found(module, node)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return Found(module, node)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name \
                    and node.value is not None:
                return Found(module, node)
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        source = _absolute(module, pkg, node.level, node.module)
                        found = self.find(source, alias.name, depth + 1)
                        if found is None and self.src.module_file(f"{source}.{alias.name}"):
                            return Found(f"{source}.{alias.name}", None)
                        return found
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name and self.src.module_file(alias.name):
                        return Found(alias.name, None)
        for node in _top_level(tree.body):
            # vllm/__init__.py: MODULE_ATTRS = {"LLM": ".entrypoints.llm:LLM", ...} read by __getattr__
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict):
                for key, value in zip(node.value.keys, node.value.values):
                    if isinstance(key, ast.Constant) and key.value == name and isinstance(value, ast.Constant) \
                            and isinstance(value.value, str) and ":" in value.value:
                        mod, attr = value.value.split(":", 1)
                        level = len(mod) - len(mod.lstrip("."))
                        return self.find(_absolute(module, pkg, level, mod.lstrip(".") or None), attr, depth + 1)
            # vllm/platforms/__init__.py: def __getattr__(name): if name == "current_platform": ...
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                if any(isinstance(c, ast.Constant) and c.value == name for c in ast.walk(node)):
                    return Found(module, None)
        if self.src.module_file(f"{module}.{name}"):
            return Found(f"{module}.{name}", None)
        return None

    def resolve_expr(self, module: str, expr: ast.expr) -> Found | None:
        """A base-class expression (``Name`` or ``a.b.Name``) to its definition."""
        if isinstance(expr, ast.Name):
            return self.find(module, expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self.resolve_expr(module, expr.value)
            if owner is not None and owner.node is None:
                return self.find(owner.module, expr.attr)
        if isinstance(expr, ast.Subscript):  # Generic[T]-style bases
            return self.resolve_expr(module, expr.value)
        return None

    def mro(self, found: Found, depth: int = 0) -> Iterator[tuple[str, ast.ClassDef]]:
        """The class and its resolvable bases (depth first; good enough for member lookup)."""
        if depth > 12 or not isinstance(found.node, ast.ClassDef):
            return
        yield found.module, found.node
        for base in found.node.bases:
            parent = self.resolve_expr(found.module, base)
            if parent is not None:
                yield from self.mro(parent, depth + 1)

    def member(self, found: Found, name: str) -> tuple[str, ast.AST] | None:
        for module, cls in self.mro(found):
            for node in cls.body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                    return module, node
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                    return module, node
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                        for t in node.targets):
                    return module, node
            for sub in ast.walk(cls):
                targets: list[ast.expr] = []
                if isinstance(sub, ast.Assign):
                    targets = sub.targets
                elif isinstance(sub, ast.AnnAssign | ast.AugAssign):
                    targets = [sub.target]
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name) \
                            and t.value.id == "self":
                        return module, sub
        return None
