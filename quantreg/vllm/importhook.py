"""Run a callback right after a module is imported, without importing it ourselves.

vLLM loads general plugins in every process, long before (and sometimes without) importing
its MoE layer module, and importing that module costs ~8 s here. So ``register()`` arms this
one-shot finder instead; the patch is applied the moment vLLM imports the module itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, callback: Callable[[ModuleType], None]) -> None:
        self._inner = inner
        self._callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, ... for tracebacks and inspect
        return getattr(self._inner, name)


class PostImportHook(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` entry that wraps one module's loader, then removes itself."""

    def __init__(self, module_name: str, callback: Callable[[ModuleType], None]) -> None:
        self.module_name = module_name
        self.callback = callback

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.module_name:
            return None
        self.disarm()
        spec: importlib.machinery.ModuleSpec | None = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            found = find(fullname, path, target) if find is not None else None
            if isinstance(found, importlib.machinery.ModuleSpec):
                spec = found
                break
        if spec is None:
            return None
        if spec.loader is not None:
            spec.loader = _CallbackLoader(spec.loader, self.callback)
        return spec

    def arm(self) -> None:
        """Patch now if the module is already imported, else wait for its import."""
        module = sys.modules.get(self.module_name)
        if module is not None:
            self.callback(module)
        elif self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def disarm(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
