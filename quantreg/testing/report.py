"""Results of a conformance run: one row per check, PASS / FAIL / SKIPPED, and the table around them.

Kept free of torch and vLLM so the CLI, the pytest plugin and JSON consumers can hold and render
results without importing the stack that produced them.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Status(str, Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIPPED = "SKIPPED"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome. ``detail`` says what was verified, what differs, or why it was skipped."""

    check: str
    title: str
    status: Status
    detail: str
    needs_device: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "title": self.title, "status": self.status.value, "detail": self.detail,
                "needs_device": self.needs_device}


@dataclass
class Report:
    """Everything ``quantreg check-method`` prints: who was checked, where, and each check's row."""

    method: str
    device: str
    target: str = ""
    plugin: str = ""
    availability: str = ""
    available: bool = False
    tolerance: float | None = None
    quant_format: str = ""
    shape: str = ""
    """The layer shape the weights and numerical checks built (``E=.., H=.., I=..``)."""
    numerics: str = ""
    """What the method declares it rounds, per what block (``Method.numerics``; empty: not declared)."""
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No check failed (skipped checks are not failures, and never passes)."""
        return not any(r.status is Status.FAIL for r in self.results)

    def result(self, check: str) -> CheckResult:
        for r in self.results:
            if r.check == check:
                return r
        raise KeyError(f"no check {check!r} in this report (checks: {', '.join(r.check for r in self.results)})")

    def counts(self) -> dict[Status, int]:
        return {s: sum(r.status is s for r in self.results) for s in Status}

    def summary(self) -> str:
        c = self.counts()
        verdict = "conforms" if self.ok and not c[Status.SKIPPED] else ("FAILS" if not self.ok else "no failures")
        return (f"{self.method} on {self.device}: {verdict} -- {c[Status.PASS]} passed, {c[Status.FAIL]} failed, "
                f"{c[Status.SKIPPED]} skipped")

    def render(self, width: int = 110) -> str:
        """The pass/fail table: status, check, and the detail wrapped under it."""
        head = [f"method {self.method}" + (f" (plugin {self.plugin}, {self.target})" if self.target else "")]
        if self.target:
            head.append(f"device {self.device}: {'available' if self.available else 'NOT available'}"
                        + (f" ({self.availability})" if self.availability else ""))
        if self.quant_format:
            tol = f", tolerance {self.tolerance:g} (max |out - ref| / max |ref|)" if self.tolerance is not None else ""
            head.append(f"format {self.quant_format}{tol}" + (f", layer {self.shape}" if self.shape else ""))
        if self.numerics:
            head.append(f"numerics {self.numerics}")
        name_w = max([len(r.check) for r in self.results] + [5])
        lines = [*head, ""]
        indent = " " * (2 + 7 + 2 + name_w + 2)
        for r in self.results:
            first = f"  {r.status.value:<7}  {r.check:<{name_w}}  "
            body = r.detail or r.title
            wrapped = textwrap.wrap(body, width=max(40, width - len(indent)), break_on_hyphens=False,
                                    break_long_words=False) or [""]
            lines.append(first + wrapped[0])
            lines += [indent + w for w in wrapped[1:]]
        lines += ["", self.summary()]
        return "\n".join(lines)

    def for_terminal(self, *, as_json: bool = False) -> str:
        """What ``quantreg check-method`` prints: the JSON, or the table at the terminal's width
        (80 to 140 columns, so it stays readable in a narrow CI log and a wide window alike)."""
        if as_json:
            return json.dumps(self.to_json(), indent=2)
        return self.render(width=min(140, max(80, shutil.get_terminal_size().columns)))

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method, "device": self.device, "target": self.target, "plugin": self.plugin,
            "available": self.available, "availability": self.availability, "quant_format": self.quant_format,
            "tolerance": self.tolerance, "shape": self.shape, "numerics": self.numerics, "ok": self.ok,
            "counts": {s.value: n for s, n in self.counts().items()},
            "results": [r.to_json() for r in self.results],
        }
