"""``quantreg tune MODEL_DIR --device cpu``: measure, then write the table (see docs/tune.md).

Why a command and not a benchmark: the answer ("which correct method is fastest for *this*
checkpoint on *this* host") is only useful as a table vLLM reads, with the evidence beside it.
It never starts a server: the methods are built on real vLLM layers in this process.

Progress goes to stderr (a bar when stderr is a terminal, one plain line per step otherwise);
stdout holds the summary, or one JSON object with ``--json``. The table is written only at the
end and atomically (:func:`quantreg.tune.table.write_atomically`): Ctrl-C leaves the previous
file, or none, never a part.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from datetime import datetime, timezone
from typing import Any, TextIO

from ..bounds import MAX_BUDGET_S, number_problem
from ..envelope import envelope
from ..error_measure import DEFAULT_TOLERANCE
from ..files import WriteRefused
from ..host import host_facts, memory_available
from ..installed import dist_version, installed_vllm_version
from ..keys import Key
from ..pins import running_pins
from ..plan import quant_format_of, read_checkpoint
from ..problems import describe, printable, problem_json
from ..registry import Registry
from ..table.verify import FLOAT64_FORMATS
from ..writing import file_target_problem
from .rank import DEFAULT_TOKENS, PHASE_WEIGHTS, TOKENS, curve, order_with_noise, ranked
from .table import phase_text, render, tuned_rules, write_atomically

DEFAULT_BUDGET = 120.0
"""Seconds: a 20B-shaped layer (E=32, H=I=2880) on 2 cores builds, checks and times two methods within it."""
DEFAULT_OUT = "tuned.yaml"
MAX_TOKENS = 8192
"""The largest token count ``--tokens`` accepts: a prefill chunk vLLM-CPU schedules, not a typo's 10**9."""


def parse_tokens(text: str | None) -> tuple[list[int] | None, str | None]:
    """``--tokens 1,8,64`` -> the counts to time (with the score's 1, 64, 256), or why not.

    ``None``: the default, :data:`quantreg.tune.rank.DEFAULT_TOKENS`.
    """
    if text is None:
        return sorted({*DEFAULT_TOKENS, *TOKENS}), None
    counts = set()
    for part in text.split(","):
        part = part.strip()
        if part.isascii() and part.isdigit() and len(part) > len(str(MAX_TOKENS)) + 2:  # int() refuses 4300+ digits
            return None, (f"--tokens {printable(text[:24])}...: item {printable(part[:12])}... is too large "
                          f"({len(part):,} digits); expected "
                          f"comma-separated whole numbers from 1 to {MAX_TOKENS}, e.g. 1,2,4,8,16,32,64")
        if not (part.isascii() and part.isdigit()) or not 1 <= int(part) <= MAX_TOKENS:
            return None, (f"--tokens {printable(text)}: {printable(part) or 'an empty item'} is not a token count; "
                          f"expected comma-separated whole numbers from 1 to {MAX_TOKENS}, e.g. 1,2,4,8,16,32,64")
        counts.add(int(part))
    return sorted(counts | set(TOKENS)), None


class ProgressLine:
    """A bar on a terminal, one plain line per step otherwise (logs and CI stay readable); quiet when asked.

    On a terminal every step is shown, down to one method at one token count with the seconds
    left; elsewhere only the coarse steps (build, check, each timing round, warnings), one line
    each. ``quiet`` (``--json``) shows only warnings: the answer is the JSON object.
    """

    def __init__(self, stream: TextIO | None = None, quiet: bool = False) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self.quiet = quiet

    def __call__(self, step: str, fraction: float, detail: bool = False) -> None:
        if (self.quiet and ": WARNING " not in step) or (detail and not self.tty):
            return
        elapsed = time.monotonic() - self.start
        step = printable(step)  # method names and the checkpoint's model_type come from outside
        if self.tty:
            filled = int(max(0.0, min(1.0, fraction)) * 24)
            self.stream.write(f"\r\x1b[2K[{'#' * filled}{'.' * (24 - filled)}] {elapsed:5.0f}s {step}"[:160])
        else:
            self.stream.write(f"quantreg tune: {elapsed:.0f}s {step}\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (empty where the platform has none): the noise's context."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return []


def _fail(message: str, as_json: bool, code: int = 1, registry: Registry | None = None,
          config: list[str] | None = None, path: str | None = None, key: str | None = None) -> int:
    """One ``quantreg tune: ...`` line on stderr; with ``--json`` the answer too (``error`` and the envelope)."""
    if as_json:
        found = [*(registry.faults if registry is not None else ()), problem_json(message, path=path, key=key)]
        print(json.dumps({"ok": False, "error": message, **envelope(found, registry, config or [])}))
    print(f"quantreg tune: {printable(message)}", file=sys.stderr)
    return code


#: Copies of a layer's packed experts alive at once while measuring: the experts read, vLLM's
#: parameters of one built method, a method's own repack, headroom for the float64 check.
MEMORY_COPIES = 4


def memory_needed(experts: int, hidden: int, intermediate: int, top_k: int = 0) -> int:
    """Bytes measuring one MoE layer of this shape takes, estimated from its MXFP4 size (no allocation).

    Per expert: w13 ``2I x H`` and w2 ``H x I`` at half a byte per weight plus one E8M0 scale per
    32, and bf16 biases; times :data:`MEMORY_COPIES`.
    """
    weights = 2 * intermediate * hidden + hidden * intermediate
    per_expert = weights // 2 + weights // 32 + 2 * (2 * intermediate + hidden)
    return MEMORY_COPIES * experts * per_expert


def shape_problem(experts: int, hidden: int, intermediate: int, top_k: int) -> str | None:
    """Why config.json's expert shape cannot be measured (``None``: it can), said with the values.

    Why here: the float64 reference routes ``top_k`` of ``experts`` and decodes blocks of 32
    values; a checkpoint that breaks either used to end in a traceback from torch.
    """
    if experts < 1:
        return f"num_local_experts is {experts}; expected at least 1"
    if not 1 <= top_k <= experts:
        return f"num_experts_per_tok is {top_k}; expected 1 to num_local_experts ({experts})"
    for name, value in (("hidden_size", hidden), ("intermediate_size", intermediate)):
        if value < 32 or value % 32:
            return f"{name} is {value}; expected a positive multiple of 32 (MXFP4 blocks hold 32 values)"
    return None


def experts_problem(experts: Any, shape: Any) -> str | None:
    """Why the experts read from the checkpoint do not fit ``shape`` (``None``: they do), with dtypes and shapes.

    MXFP4 blocks and scales are uint8 ``[E, 2I, H/2]`` / ``[E, 2I, H/32]`` (w13) and ``[E, H, I/2]`` /
    ``[E, H, I/32]`` (w2); biases floating ``[E, 2I]`` / ``[E, H]``. float32 blocks, or blocks short
    for their scales, made the float64 reference fail with a torch traceback.
    """
    e, h, i = shape.experts, shape.hidden, shape.intermediate
    expected = {"w13_weight": (e, 2 * i, h // 2), "w13_weight_scale": (e, 2 * i, h // 32),
                "w2_weight": (e, h, i // 2), "w2_weight_scale": (e, h, i // 32),
                "w13_bias": (e, 2 * i), "w2_bias": (e, h)}
    for name, want in expected.items():
        tensor = getattr(experts, name, None)
        if tensor is None:
            continue
        dtype = str(tensor.dtype).removeprefix("torch.")
        is_bias = name.endswith("_bias")
        if not is_bias and dtype != "uint8":
            return f"{name} is {dtype}; expected uint8 (packed MXFP4 blocks and E8M0 scales)"
        if is_bias and not tensor.is_floating_point():
            return f"{name} is {dtype}; expected a floating-point bias"
        if tuple(tensor.shape) != want:
            return (f"{name} has shape {list(tensor.shape)}; expected {list(want)} for {e} experts, hidden {h}, "
                    f"intermediate {i}")
    return None


def out_problem(out: str | None) -> str | None:
    """Why ``--out`` cannot receive the table (checked before measuring), else ``None``.

    ``-`` is stdout. The one writer's check (:func:`quantreg.writing.file_target_problem`): a
    directory, a device node, a FIFO or a socket is refused (never replaced), as is a parent that
    is not an existing writable directory; an existing symlink is replaced, never followed.
    """
    if out == "-":
        return None
    target = DEFAULT_OUT if out is None else out
    problem = file_target_problem(target, replace_symlink=True)
    return None if problem is None else f"--out {printable(target)}: {problem}"


def tune_command(model_dir: str, *, device: str = "cpu", out: str | None = None, as_json: bool = False,
                 budget: float = DEFAULT_BUDGET, synthetic: bool = False, config: list[str] | None = None,
                 tokens: str | None = None) -> int:
    """Measure every method for the checkpoint's MoE key and write the tuned table; 0 when written."""
    if device != "cpu":
        return _fail(f"--device {device}: tune measures on the CPU only (the kit's harness builds CPU layers)",
                     as_json, 2, key="--device")
    bad_budget = number_problem(budget, 0, MAX_BUDGET_S, "a number of seconds", low_open=True)
    if bad_budget:  # the CLI's argparse type says the same; it is recorded as tuned.budget_s, which a table bounds
        return _fail(f"--budget: {bad_budget}", as_json, 2, key="--budget")
    counts, bad_tokens = parse_tokens(tokens)
    if counts is None:
        return _fail(bad_tokens or "--tokens", as_json, 2, key="--tokens")
    problem = out_problem(out)
    if problem is not None:  # before minutes of measuring, not after
        return _fail(problem, as_json, 2, key="--out")
    began = time.monotonic()
    registry = Registry.build(config=config or [])  # cheap (no torch): its faults belong in every answer
    ck = read_checkpoint(model_dir)
    fail = functools.partial(_fail, as_json=as_json, registry=registry, config=config)
    if not ck.config:
        return fail("; ".join(ck.problems) or f"{model_dir}: not a checkpoint directory")
    ex = ck.experts
    if not ck.moe_layers:  # plan's located problems (an absurd num_local_experts...) say why, when it has them
        if ck.problems:
            return fail("; ".join(ck.problems), path=f"{model_dir}/config.json")
        return fail(f"{printable(model_dir)}: no MoE layers (nothing for quantreg to decide)", path=model_dir)
    try:
        shape = (int(ex["count"]), int(ex["hidden_size"]), int(ex["intermediate_size"]), int(ex["per_token"]))
    except (TypeError, ValueError, KeyError):
        return fail(f"{model_dir}/config.json: expert count, hidden/intermediate size or experts per token "
                    "missing", path=f"{model_dir}/config.json")
    bad_shape = shape_problem(*shape)
    if bad_shape is not None:  # before torch: the float64 reference would fail on it outside any containment
        return fail(f"{printable(model_dir)}/config.json: {bad_shape}", path=f"{model_dir}/config.json")
    need, free = memory_needed(*shape), memory_available()
    if free is not None and need > free:
        return fail(f"{printable(model_dir)}/config.json: a layer of {shape[0]} experts at hidden {shape[1]}, "
                    f"intermediate {shape[2]} needs about {need / 2**30:.1f} GiB to measure; {free / 2**30:.1f} GiB "
                    "is available here; nothing measured", path=f"{model_dir}/config.json")
    # the sizes are bounded and fit (above) before anything is imported or allocated: naming the quant format
    # may import vLLM (hundreds of MB), which a config.json with 10^6 experts must not cost
    quant_format, _ = quant_format_of(ck)
    key = Key(quant_format, ck.model_type, device)
    if quant_format not in FLOAT64_FORMATS:
        return fail(f"key {key}: tune measures {', '.join(FLOAT64_FORMATS)} layers only (the formats with a "
                    "float64 reference and a harness layer); nothing written", path=model_dir)
    progress = ProgressLine(quiet=as_json)
    prior = registry.resolve(key).rule  # the chain the key has now: a tie within noise keeps its order
    prior_chain = list(prior.methods) if prior is not None else []
    from .measure import LayerShape, checkpoint_experts, measure, synthetic_experts  # torch + vLLM from here on

    layer_shape = LayerShape(*shape)
    progress(f"{key}: {'random valid' if synthetic else 'checkpoint layer ' + str(ck.moe_layers[0])} experts "
             f"{layer_shape.as_json()}", 0.0)
    try:
        experts = synthetic_experts(layer_shape) if synthetic else checkpoint_experts(model_dir, ck.moe_layers[0])
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # malformed data (safetensors' own errors included) is a located line, never a traceback
        return fail(f"{printable(model_dir)}: cannot read layer {ck.moe_layers[0]}'s experts: "
                    f"{printable(describe(exc))}", path=model_dir)
    bad_experts = experts_problem(experts, layer_shape)
    if bad_experts is not None:
        return fail(f"{printable(model_dir)}: layer {ck.moe_layers[0]}'s experts: {bad_experts}; nothing measured",
                    path=model_dir)
    try:
        results, rounds = measure(registry, key, experts, layer_shape.top_k, tolerance=DEFAULT_TOLERANCE,
                                  deadline=began + budget, progress=progress, tokens=counts)
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception as exc:  # the float64 reference and the inputs are tune's own: a fault there is a located line
        progress.done()
        return fail(f"{printable(model_dir)}: measuring layer {ck.moe_layers[0]} failed: "
                    f"{printable(describe(exc, located=True))}; nothing written", path=model_dir)
    progress.done()
    evidence: dict[str, Any] = {
        "at": datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "host": host_facts().as_json(), "vllm": installed_vllm_version(), "torch": dist_version("torch"),
        "tolerance": DEFAULT_TOLERANCE, "budget_s": budget, "rounds": rounds,
        "shape": {**layer_shape.as_json(), "weights": "synthetic" if synthetic else f"layer {ck.moe_layers[0]}"},
        "load_avg": load_average(),
        # what the measurement depends on; checked wherever the rule decides (quantreg.pins)
        "pins": running_pins(registry, [r.method for r in results if r.ok], layer_shape.as_json()),
    }
    rules, decided = tuned_rules(key, results, evidence, prior=prior_chain, counts=counts)
    rule = rules[0] if rules else None
    overall, verdicts = order_with_noise(results, prior=prior_chain)  # the one-rule chain, split or not
    target = None
    text = render(rules) if rules else None
    if text is not None and out != "-":
        try:
            target = str(write_atomically(DEFAULT_OUT if out is None else out, text))
        except WriteRefused as exc:  # the directory vanished, became read-only, or a FIFO appeared meanwhile
            return fail(f"--out {printable(DEFAULT_OUT if out is None else out)}: {exc}", key="--out")
    elif text is not None and not as_json:  # --out -: the table is stdout (with --json the answer's "table")
        sys.stdout.write(text)
    elapsed = time.monotonic() - began
    data = {"ok": rule is not None, "model": str(model_dir), "key": dict(key._asdict()), "out": target,
            "chain": [r.method for r in overall], "phase": phase_text(PHASE_WEIGHTS),
            "tokens": counts, "rounds": rounds, "budget_s": budget, "elapsed_s": round(elapsed, 1),
            "results": [r.to_json() for r in ranked(results, prior=prior_chain)],
            "ranking": [v.text() for v in verdicts] + ([decided.text()] if rule else []), "tuned": evidence,
            # one rule for decode and prefill: the curve, the crossover (or why none) and its envelope check
            "curve": curve(results, counts), "split": decided.to_json(),
            "rules": [{"match": dict(r["match"]), "method": r["method"]} for r in rules],
            **({"table": text} if out == "-" and as_json else {}), **envelope(None, registry, config or [])}
    if as_json:
        print(json.dumps(data))
    elif out != "-":
        lines = [f"key      {printable(str(key))}", f"score    {phase_text(PHASE_WEIGHTS)}"]
        for r in ranked(results, prior=prior_chain):
            times = ", ".join(f"{t}: {v:.3g} ms" for t, v in sorted(r.ms.items()) if v is not None)
            mark = "ok  " if r.ok else ("no  " if "cannot run here" in str(r.error) else "FAIL")
            lines.append(f"  {mark} {printable(r.method)}: " + (times if r.ok else printable(str(r.error))))
            lines += [f"       warning: {printable(w)}" for w in r.warnings]
        lines.append(f"chain    {printable(', '.join(data['chain'])) or 'none: no method passed'}")
        lines += [f"ranking  {printable(v.text())}" for v in verdicts]
        if decided.crossover is not None:  # the pair written instead of the one chain above
            for written in rules:
                lines.append(f"rule     tokens {written['match']['tokens']}: {printable(', '.join(written['method']))}")
        lines.append(f"tokens   {printable(decided.text())}")
        load = evidence["load_avg"]
        if load:
            lines.append(f"load     {' '.join(f'{v:.2f}' for v in load)} (1/5/15 min load average at the end; "
                         f"{os.cpu_count() or 1} cores)")
        lines.append(f"wrote    {printable(target)}" if target else "wrote    nothing")
        lines.append(f"took     {elapsed:.0f}s ({rounds} timing round(s), budget {budget:g}s)")
        print("\n".join(lines))
    if rule is None:
        print(f"quantreg tune: no method passed for {printable(str(key))}; no table written", file=sys.stderr)
        return 1
    return 0
