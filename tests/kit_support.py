"""Helpers for the kit's tests (test_testing_conformance.py, test_testing_checks_without_vllm.py): a
method declared like the walkthrough's example, a report's statuses by check, and a plugin object
registering fixed methods (and optionally tables)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from quantreg import Method, hookimpl
from quantreg.testing import Report, Status

EXAMPLE_CLASS = "quantreg_example_plugin.method:ExampleMxfp4MoEMethod"


def method(name: str = "qrt_m", target: str = EXAMPLE_CLASS, **fields: Any) -> Method:
    fields.setdefault("devices", ("cpu",))
    fields.setdefault("requires", ("torch", "vllm"))
    fields.setdefault("options", ("compute_dtype",))
    return Method(name=name, target=target, plugin="qrt", **fields)


def statuses(report: Report) -> dict[str, Status]:
    return {r.check: r.status for r in report.results}


class _Plugin:
    """A plugin object registering fixed methods (and optionally tables)."""

    def __init__(self, *methods: Method, tables: tuple[Path, ...] = ()) -> None:
        self._methods = methods
        self._tables = tables

    @hookimpl
    def register_methods(self, register: Callable[[Method], None]) -> None:
        for m in self._methods:
            register(m)

    @hookimpl
    def register_tables(self, register: Callable[[Path | str], None]) -> None:
        for t in self._tables:
            register(t)
