"""``quantreg tune --layers KINDS``: tune's dense half (issue 30) -- attention, router and lm_head rules.

Why a separate module: the MoE half (:mod:`.command`, :mod:`.measure`) is unchanged by it. With
``--layers`` naming only ``experts`` (the default) nothing here runs and tune writes what it always
wrote. With dense kinds, this module measures each one (:mod:`.dense_measure`, real vLLM layers at
the checkpoint's real sizes from config.json) and, when ``experts`` is named too, runs the MoE half
as the command it is (its JSON answer, its table text) and writes one table with every rule.

What is different from the experts: on a bf16 dense layer vLLM's own method (``vllm``: the
checkpoint's bf16 weights, oneDNN on CPU) is exact up to bf16 rounding, and a method that
quantises (an int8 dense plugin's) is *lossy by design*, yet may still be within ``verify:``'s
tolerance. Tune says so instead of ranking it silently: a method whose float64 error is more than
:data:`LOSSY_FACTOR` times vLLM's bf16 error **and** above :data:`LOSSY_FLOOR` is refused as
``lossy`` unless ``--allow-lossy`` (it is still timed, so the operator sees what the loss would
buy). A tie within noise keeps the faithful order: the prior chain of a dense key without a rule is
``[vllm]``. Each kind's rule names ``layer: KIND`` and carries the same ``tuned:`` evidence and
``pins`` as an experts rule; its ``shape`` pin holds the kind's sizes (:func:`quantreg.pins.dense_shape`),
checked at vLLM start-up by the dense seam and by ``plan``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import yaml

from ..bounds import MAX_BUDGET_S, number_problem
from ..envelope import envelope
from ..error_measure import DEFAULT_TOLERANCE
from ..files import WriteRefused
from ..host import host_facts, memory_available
from ..installed import dist_version, installed_vllm_version
from ..keys import EXPERTS, LAYER_KINDS, Key
from ..methods import VLLM_METHOD, keeps_vllm
from ..pins import DENSE_SHAPE_FIELDS, dense_shape, running_pins
from ..plan import quant_format_of, read_checkpoint
from ..problems import did_you_mean, printable
from ..registry import Registry
from .command import DEFAULT_OUT, ProgressLine, _fail, load_average, out_problem, parse_tokens, tune_command
from .rank import PHASE_WEIGHTS, TOKENS, Result, ranked
from .table import phase_text, rule_for, write_atomically

ALL = "all"
DENSE_KINDS = tuple(k for k in LAYER_KINDS if k != EXPERTS)
LOSSY_FACTOR = 2.0
LOSSY_FLOOR = 1e-3
"""A method is lossy when its float64 error exceeds both ``LOSSY_FACTOR`` x vLLM's bf16 error and this."""
MEMORY_COPIES = 5
"""bf16 copies of a kind's weights alive at once: the float64 check's source, vLLM's layer and its oneDNN
prepacked copy, a method's layer while it converts, the float64 reference blocks (measured: 5.7 GB peak
for the 20B lm_head's 1.16 GB)."""
MODEL_TYPES = ("gpt_oss",)
"""The models whose dense layers tune builds (quantreg/testing/gpt_oss_dense.py: vLLM's GPT-OSS classes)."""
HEADER = """\
# Written by `quantreg tune --layers {layers}`: one rule per key of the checkpoint (layer kind),
# its chain ordered by measured speed on this host, fastest first; two methods apart only beyond
# the measured noise (tuned.ranking).
# Score: {phase}.
# Only methods that matched the float64 reference within the tolerance are in a chain; a dense method
# beyond 2x bf16's error is lossy and only chained with --allow-lossy. Start-up and plan check
# tuned.pins (the shape of each kind included). Re-run tune after changing hardware, vLLM or plugins.
"""


def parse_layers(text: str) -> tuple[tuple[str, ...], str | None]:
    """``--layers`` (``experts``, ``lm_head,attention``, ``all``) as layer kinds in :data:`LAYER_KINDS`
    order, or a message naming the bad value and what is expected."""
    names = [p.strip() for p in str(text).split(",")]
    expected = f"expected {', '.join(LAYER_KINDS)} or {ALL}, comma-separated (such as --layers experts,lm_head)"
    if not text.strip() or any(not n for n in names):
        return (), f"--layers {printable(repr(text))}: an empty layer kind; {expected}"
    if ALL in names:
        if len(names) > 1:
            return (), f"--layers {printable(text)}: '{ALL}' already names every kind; give it alone"
        return LAYER_KINDS, None
    for name in names:
        if name not in LAYER_KINDS:
            hint = did_you_mean(name, (*LAYER_KINDS, ALL))
            return (), f"--layers {printable(text)}: unknown layer kind '{printable(name)}'{hint}; {expected}"
    return tuple(k for k in LAYER_KINDS if k in names), None


def is_lossy(error: float | None, bf16_error: float | None) -> bool:
    """Beyond :data:`LOSSY_FACTOR` x vLLM's bf16 error and above :data:`LOSSY_FLOOR` (no baseline: the floor)."""
    if error is None:
        return False
    return error > LOSSY_FLOOR and error > LOSSY_FACTOR * (bf16_error or 0.0)


def judge_lossy(results: Sequence[Result], allow: bool) -> list[str]:
    """Mark the lossy methods among ``results`` (refused, or warned with ``allow``); their names.

    The baseline is ``vllm``'s own error (bf16 rounding); vLLM's method is never lossy against itself.
    """
    base = next((r.rel_error for r in results if keeps_vllm(r.method) and r.ok), None)
    lossy = []
    for r in results:
        if not r.ok or keeps_vllm(r.method) or not is_lossy(r.rel_error, base):
            continue
        lossy.append(r.method)
        base_text = f"vLLM's bf16 error {base:.3g}" if base is not None else "no bf16 baseline measured"
        text = (f"lossy: float64 error {r.rel_error:.3g} > {LOSSY_FACTOR:g} x {base_text} and > {LOSSY_FLOOR:g} "
                "(a quantised copy of the bf16 weights)")
        if allow:
            r.warnings.append(f"{text}; chained because --allow-lossy")
        else:
            r.ok, r.error = False, f"{text}; refused without --allow-lossy"
    return lossy


def shape_of(config: dict[str, Any], kinds: Sequence[str]) -> tuple[dict[str, int], str | None]:
    """Every dense size the kinds need, from config.json's names, or why not (naming the keys)."""
    found: dict[str, int] = {}
    for kind in kinds:
        shape = dense_shape(config, kind)
        if shape is None:
            from ..pins import CONFIG_NAMES

            keys = ", ".join(CONFIG_NAMES[f] for f in DENSE_SHAPE_FIELDS[kind])
            return {}, f"config.json: {keys}: expected positive whole numbers for the {kind} layers' shape"
        found.update(shape)
    return found, None


def kind_bytes(kind: str, s: dict[str, int]) -> int:
    """bf16 bytes of one ``kind``'s weights (GPT-OSS: qkv + o_proj; the router; the lm_head)."""
    if kind == "attention":
        q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
        return 2 * (s["hidden"] * (q + 2 * kv) + q * s["hidden"])
    if kind == "dense":
        return 2 * s["hidden"] * s["experts"]
    return 2 * s["hidden"] * s["vocab"]


def _moe_part(model_dir: str, *, device: str, budget: float, synthetic: bool,
              config: list[str] | None, tokens: str | None) -> tuple[int, dict[str, Any]]:
    """The MoE half as the command it is: its JSON answer (``table`` holds its rule's YAML)."""
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        code = tune_command(model_dir, device=device, out="-", as_json=True, budget=budget, synthetic=synthetic,
                            config=config, tokens=tokens)
    text = captured.getvalue().strip().splitlines()
    try:
        data = json.loads(text[-1]) if text else {}
    except ValueError:
        data = {"ok": False, "error": f"the MoE half answered no JSON: {printable(captured.getvalue()[:200])}"}
    return code, data if isinstance(data, dict) else {}


def render_rules(rules: Sequence[dict[str, Any]], kinds: Sequence[str]) -> str:
    body = yaml.safe_dump({"version": 1, "rules": [dict(r) for r in rules]}, sort_keys=False,
                          default_flow_style=None, width=120, allow_unicode=False)
    return HEADER.format(layers=",".join(kinds), phase=phase_text(PHASE_WEIGHTS)) + body


def tune_layers(model_dir: str, layers: str, *, device: str = "cpu", out: str | None = None,
                as_json: bool = False, budget: float = 120.0, synthetic: bool = False, allow_lossy: bool = False,
                config: list[str] | None = None, tokens: str | None = None) -> int:
    """Measure every requested layer kind and write one table with a rule per kind; 0 when every kind got one.

    ``layers`` is ``--layers`` as written (:func:`parse_layers`); ``experts`` alone is
    :func:`.command.tune_command` itself (the table it always wrote). ``tokens`` (``--tokens``) is the
    experts' token-count curve and goes to their half; a dense kind is timed at the score's counts
    and never split by token count, so ``--tokens`` without ``experts`` is refused, not ignored."""
    kinds, bad = parse_layers(layers)
    if bad is not None:
        return _fail(bad, as_json, 2, key="--layers")
    if device != "cpu":
        return _fail(f"--device {device}: tune measures on the CPU only (the kit's harness builds CPU layers)",
                     as_json, 2, key="--device")
    bad_budget = number_problem(budget, 0, MAX_BUDGET_S, "a number of seconds", low_open=True)
    if bad_budget:
        return _fail(f"--budget: {bad_budget}", as_json, 2, key="--budget")
    if allow_lossy and EXPERTS in kinds and len(kinds) == 1:
        return _fail("--allow-lossy: only dense layer kinds have a lossy judgement; --layers experts names none "
                     f"(add {', '.join(DENSE_KINDS)} or {ALL})", as_json, 2, key="--allow-lossy")
    bad_tokens = parse_tokens(tokens)[1]
    if bad_tokens is not None:  # the experts' half would refuse it: said before anything is read
        return _fail(bad_tokens, as_json, 2, key="--tokens")
    if tokens is not None and EXPERTS not in kinds:
        return _fail(f"--tokens: the token counts of the experts' crossover curve; --layers {printable(layers)} names "
                     f"no experts (add experts, or leave --tokens out: dense kinds are timed at "
                     f"{', '.join(map(str, TOKENS))} tokens)", as_json, 2, key="--tokens")
    problem = out_problem(out)
    if problem is not None:  # before minutes of measuring, not after
        return _fail(problem, as_json, 2, key="--out")
    if kinds == (EXPERTS,):
        return tune_command(model_dir, device=device, out=out, as_json=as_json, budget=budget, synthetic=synthetic,
                            config=config, tokens=tokens)
    began = time.monotonic()
    registry = Registry.build(config=config or [])
    ck = read_checkpoint(model_dir)
    where = f"{printable(model_dir)}/config.json"

    def fail(message: str, code: int = 1, **extra: Any) -> int:
        return _fail(message, as_json, code, registry=registry, config=config, **extra)

    if not ck.config:
        return fail("; ".join(ck.problems) or f"{printable(model_dir)}: not a checkpoint directory")
    dense = [k for k in kinds if k != EXPERTS]
    if ck.model_type not in MODEL_TYPES:
        return fail(f"{where}: model_type {printable(ck.model_type)}: tune builds the dense layers of "
                    f"{', '.join(MODEL_TYPES)} only (vLLM's classes for that model); nothing measured", path=where,
                    key="model_type")
    sizes, problem = shape_of(ck.config, dense)
    if problem is not None:
        return fail(f"{printable(model_dir)}/{problem}", path=where)
    need = max(MEMORY_COPIES * kind_bytes(k, sizes) for k in dense)
    free = memory_available()
    if free is not None and need > free:
        return fail(f"{where}: measuring the {'/'.join(dense)} layers at these sizes needs about "
                    f"{need / 2**30:.1f} GiB; {free / 2**30:.1f} GiB is available here; nothing measured", path=where)
    quant_format, _ = quant_format_of(ck)
    progress = ProgressLine(quiet=as_json)
    rules: list[dict[str, Any]] = []
    answers: dict[str, Any] = {}
    missing: list[str] = []
    share = budget / len(kinds)
    if EXPERTS in kinds:
        progress(f"experts: the MoE half (budget {share:.0f}s)", 0.0)
        code, moe = _moe_part(model_dir, device=device, budget=share, synthetic=synthetic, config=config,
                              tokens=tokens)
        if code == 2 or (code != 0 and not moe.get("results")):  # the MoE half refused: its answer is ours
            if as_json:
                print(json.dumps(moe))
            return code
        answers[EXPERTS] = {k: moe.get(k) for k in ("key", "chain", "ranking", "results", "rounds", "tuned", "ok",
                                                         "tokens", "split")}
        table = yaml.safe_load(moe.get("table") or "") or {}
        rules += list(table.get("rules") or [])
        if not table.get("rules"):
            missing.append(EXPERTS)
    from ..testing.gpt_oss_dense import DenseShape
    from .dense_measure import checkpoint_names, checkpoint_tensors, measure_dense, synthetic_tensors, tensors_problem

    full = {f: sizes.get(f, 1) for f in ("hidden", "heads", "kv_heads", "head_dim", "vocab", "experts")}
    shape = DenseShape(**full)
    tied = bool(ck.config.get("tie_word_embeddings"))
    for i, kind in enumerate(dense):
        key = Key(quant_format, ck.model_type, device, kind)
        left = max(budget - (time.monotonic() - began), 0.0) / (len(dense) - i)
        kind_shape = {f: sizes[f] for f in DENSE_SHAPE_FIELDS[kind]}
        weights = "synthetic" if synthetic else ("layer 0" if kind != "lm_head" else "lm_head")
        progress(f"{key}: {weights} weights {kind_shape} (budget {left:.0f}s)", 0.0)
        try:
            tensors = (synthetic_tensors(kind, shape) if synthetic
                       else checkpoint_tensors(model_dir, checkpoint_names(kind, 0, tied)))
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            progress.done()
            return fail(f"{printable(model_dir)}: cannot read the {kind} weights: {printable(str(exc))}",
                        path=model_dir)
        bad_tensors = tensors_problem(kind, shape, tensors)
        if bad_tensors is not None:  # before any layer is built: named, never vLLM's loader's KeyError
            progress.done()
            return fail(f"{printable(model_dir)}: the {kind} weights ({weights}): {bad_tensors}; nothing measured",
                        path=model_dir)
        try:
            results, rounds = measure_dense(registry, key, shape, tensors, tolerance=DEFAULT_TOLERANCE,
                                            deadline=time.monotonic() + left, progress=progress)
        except (KeyboardInterrupt, MemoryError):
            raise
        except Exception as exc:  # tune's own reference and inputs (a weight that does not fit its layer...)
            progress.done()
            from ..problems import describe

            return fail(f"{printable(model_dir)}: measuring the {kind} layers failed: "
                        f"{printable(describe(exc, located=True))}; nothing written", path=model_dir)
        del tensors
        lossy = judge_lossy(results, allow_lossy)
        prior_rule = registry.resolve(key).rule
        prior = list(prior_rule.methods) if prior_rule is not None else [VLLM_METHOD]
        evidence: dict[str, Any] = {
            "at": datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
            "host": host_facts().as_json(), "vllm": installed_vllm_version(), "torch": dist_version("torch"),
            "tolerance": DEFAULT_TOLERANCE, "budget_s": budget, "rounds": rounds,  # the run's, as for the experts
            "shape": {**kind_shape, "weights": weights}, "load_avg": load_average(),
            "pins": running_pins(registry, [r.method for r in results if r.ok or r.method in lossy], kind_shape),
        }
        rule = rule_for(key, results, evidence, prior=prior)
        if rule is None:
            missing.append(kind)
        else:
            rule["match"] = {**rule["match"], "layer": kind}
            if lossy and allow_lossy:
                rule["note"] += f"; lossy, chained with --allow-lossy: {', '.join(lossy)}"
            rules.append(rule)
        answers[kind] = {"key": key.as_json(), "chain": rule["method"] if rule else [],
                         "ranking": rule["tuned"]["ranking"] if rule else [], "lossy": lossy, "rounds": rounds,
                         "results": [r.to_json() for r in ranked(results, prior=prior)], "tuned": evidence}
    progress.done()
    text = render_rules(rules, kinds) if rules else None
    target = None
    if text is not None and out != "-":
        try:
            target = str(write_atomically(DEFAULT_OUT if out is None else out, text))
        except WriteRefused as exc:
            return fail(f"--out {printable(DEFAULT_OUT if out is None else out)}: {exc}", key="--out")
    elif text is not None and not as_json:
        sys.stdout.write(text)
    elapsed = time.monotonic() - began
    data = {"ok": not missing, "model": str(model_dir), "layers": list(kinds), "out": target,
            "allow_lossy": allow_lossy, "phase": phase_text(PHASE_WEIGHTS), "tokens": list(TOKENS),
            "budget_s": budget, "elapsed_s": round(elapsed, 1), "keys": answers,
            **({"table": text} if out == "-" and as_json else {}), **envelope(None, registry, config or [])}
    if as_json:
        print(json.dumps(data))
    elif out != "-":
        print("\n".join(summary_lines(answers, target, elapsed, budget)))
    if missing:
        print(printable(f"quantreg tune: no method passed for {', '.join(missing)}; "
                        + ("no table written" if text is None else "the table has no rule for them")),
              file=sys.stderr)
        return 1
    return 0


def summary_lines(answers: dict[str, Any], target: str | None, elapsed: float, budget: float) -> list[str]:
    """The human summary: per kind its key, each method's medians or why it was refused, the chain."""
    lines = [f"score    {phase_text(PHASE_WEIGHTS)}"]
    for a in answers.values():
        key = Key(**a["key"]) if isinstance(a.get("key"), dict) else None
        lines.append(f"key      {printable(str(key))}")
        for r in a.get("results") or []:
            ms = r.get("ms") or {}
            times = ", ".join(f"{t}: {v:.3g} ms" for t, v in sorted(ms.items(), key=lambda i: int(i[0]))
                              if v is not None)
            err = r.get("rel_error")
            err_text = f"; float64 error {err:.3g}" if isinstance(err, (int, float)) else ""
            error = str(r.get("error") or "")
            mark = ("ok  " if r.get("ok") else "no  " if "cannot run here" in error
                    else "lossy" if error.startswith("lossy") else "FAIL")
            body = times + err_text if r.get("ok") else printable(error) + (f" (timed: {times})" if times else "")
            lines.append(f"  {mark} {printable(str(r.get('method')))}: {body}")
            lines += [f"       warning: {printable(w)}" for w in r.get("warnings") or []]
        lines.append(f"chain    {printable(', '.join(a.get('chain') or [])) or 'none: no method passed'}")
        lines += [f"ranking  {printable(v)}" for v in a.get("ranking") or []]
    load = load_average()
    if load:
        lines.append(f"load     {' '.join(f'{v:.2f}' for v in load)} (1/5/15 min load average at the end; "
                     f"{os.cpu_count() or 1} cores)")
    lines.append(f"wrote    {printable(target)}" if target else "wrote    nothing")
    lines.append(f"took     {elapsed:.0f}s (budget {budget:g}s)")
    return lines
