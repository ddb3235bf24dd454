"""``quantreg demo``: the registry deciding, and vLLM obeying, on a tiny GPT-OSS MXFP4 model.

1. Write a tiny GPT-OSS MXFP4 checkpoint (real HF layout) into a temp dir.
2. ``explain`` its key with the installed tables, then with the demo's embedded table, which
   asks for ``[hpu_mxfp4, mxfp4_reference]``: on a CPU the Gaudi kernel is unavailable and the
   chain falls back, with the reason printed.
3. Run vLLM (default multiprocessing) twice, side by side, from the demo's work directory (so
   vLLM imports the installed distributions, never a source tree): once on the MXFP4 checkpoint
   with the installed tables -- what an operator gets after installing the plugins -- and once as
   the comparison. Print the method class each MoE layer got *in the Worker process*, the
   quantreg start-up line saying which method served and why, the generated token ids, and how far
   the two runs' logprobs and MoE outputs are apart. A line every 15 s while vLLM runs.

4. End with one verdict line against the bounds stated below (:func:`verdict`): a newcomer should
   not have to know whether "0.0531" is good.

Host-conditional, from the one answer :func:`quantreg.vllm_limits.vllm_cpu_mxfp4_kernel` gives (the
one ``doctor`` prints): vLLM 0.32's only CPU MXFP4 MoE kernel needs AMX. On a host with AMX the
installed tables keep vLLM's own MXFP4 kernel (quantreg-cpu-mxfp4's chain ``[vllm, cpu_mxfp4]``),
and the comparison is the demo's embedded table (``mxfp4_reference``) on the same checkpoint.
Without AMX vLLM alone refuses the MXFP4 checkpoint, the installed tables serve it with the best
installed method (``cpu_mxfp4`` when quantreg-cpu-mxfp4 is installed, else the chain's next), and
the comparison is vLLM's own method on the bf16 twin of the checkpoint (the same expert weights
dequantised exactly).

Bounds (measured; tests/e2e/test_mxfp4_reference.py holds the same comparison): greedy tokens
identical; logprob of a token at the same step within 0.15 (seen 0.098 on the demo's three prompts,
one of 140 tokens, on an AMD EPYC host; the test's shorter prompts see 0.053 against its 0.1: the
random tiny model's near-flat logits amplify one bf16 rounding); MoE outputs on a fixed input
within the two methods' stated errors added up: each method declares how far it may be from the
float64 MoE (``quantreg_tolerance``, as a fraction of the layer's largest output; vLLM's own methods
declare none and get the kit's default, 0.02), so two of them can differ by at most the sum
(seen 0.0312-0.0625 on outputs up to 8.6, 1-2 bf16 ULPs, against a bound of ~0.26-0.34).
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .. import settings
from ..envelope import envelope
from ..error_measure import DEFAULT_TOLERANCE
from ..files import WriteRefused
from ..host import guess_device
from ..keys import Key
from ..problems import printable, problem_json
from ..registry import Registry
from ..testing.vllm_run import DEMO_PROMPTS, RunResult, run_vllm
from ..vllm_limits import KernelVerdict, vllm_cpu_mxfp4_kernel
from ..writing import dir_target_problem, fresh_directory, make_directory, replace_file

DEMO_TABLE = """\
# quantreg demo table: route GPT-OSS MXFP4 to the Gaudi kernel, or to its CPU reference.
version: 1
rules:
  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss}
    method: [hpu_mxfp4, mxfp4_reference]
    note: demo; Gaudi kernel where present, else the pure-torch reference of it
"""
MAX_TOKENS = 6
PROBE_TOKENS = 8
LOGPROB_BOUND = 0.15


def _max_logprob_diff(a: RunResult, b: RunResult) -> float | None:
    """Largest |logprob| difference of the same token at the same step, while the runs agree."""
    worst: float | None = None
    for ids_a, ids_b, tops_a, tops_b in zip(a.token_ids, b.token_ids, a.top_logprobs, b.top_logprobs):
        for step, (ta, tb) in enumerate(zip(ids_a, ids_b)):
            for token in set(tops_a[step]) & set(tops_b[step]):
                d = abs(tops_a[step][token] - tops_b[step][token])
                worst = d if worst is None else max(worst, d)
            if ta != tb:
                break
    return worst


def stated_error(registry: Registry, method: str) -> float:
    """How far ``method`` says its MoE output may be from float64, as a fraction of the layer's
    largest output: its class's ``quantreg_tolerance`` (the kit holds it to that), else the kit's
    default for a method that states none (vLLM's own)."""
    found = registry.methods.get(method)
    if found is None or found.keeps_vllm:
        return DEFAULT_TOLERANCE
    try:
        tol = getattr(found.load(), "quantreg_tolerance", DEFAULT_TOLERANCE)
    except Exception:  # the run itself reports a method that does not load
        return DEFAULT_TOLERANCE
    return float(tol) if isinstance(tol, (int, float)) and 0 < tol < 1 else DEFAULT_TOLERANCE


def _max_moe_diff(a: RunResult, b: RunResult, stated: float) -> tuple[float, float] | None:
    """(worst |MoE output difference|, its bound: ``stated`` (the two methods' stated errors added up)
    times that layer's largest output), the layer closest to its bound."""
    try:
        out_a, out_b = a.load_moe_outputs(), b.load_moe_outputs()
    except (ValueError, OSError):
        return None
    worst: tuple[float, float] | None = None
    for k in (k for k in out_a if k != "input" and k in out_b):
        diff = float((out_a[k].float() - out_b[k].float()).abs().max())
        bound = stated * max(float(out_a[k].float().abs().max()), float(out_b[k].float().abs().max()))
        if worst is None or diff / bound > worst[0] / worst[1]:
            worst = (diff, bound)
    return worst


def verdict(own: RunResult, routed: RunResult, lp: float | None, moe: tuple[float, float] | None) -> tuple[bool, str]:
    """PASS or FAIL against the stated bounds, with the numbers and the bounds in one line."""
    if not (own.ok and routed.ok):
        failed = [name for name, r in (("installed tables", own), ("comparison", routed)) if not r.ok]
        return False, f"FAIL: the {' and '.join(failed)} run failed (see its error above)"
    pairs = [(x, y) for a, b in zip(own.token_ids, routed.token_ids) for x, y in zip(a, b)]
    total = sum(len(ids) for ids in own.token_ids)
    equal = sum(x == y for x, y in pairs)
    checks = [(equal == total and len(pairs) == total, f"tokens equal {equal}/{total}")]
    checks.append((lp is not None and lp <= LOGPROB_BOUND,
                   f"max logprob diff {'n/a' if lp is None else f'{lp:.3f}'} ≤ {LOGPROB_BOUND}"))
    checks.append((moe is not None and moe[0] <= moe[1],
                   "max MoE output diff n/a" if moe is None else
                   f"max MoE output diff {moe[0]:.4f} ≤ {moe[1]:.4f} "
                   "(the two methods' stated errors of the layer's largest output)"))
    ok = all(passed for passed, _ in checks)
    shown = [text if passed else f"{text} FAILED" for passed, text in checks]
    return ok, f"{'PASS' if ok else 'FAIL'}: {', '.join(shown)}"


def own_method_plan(kernel: KernelVerdict) -> tuple[bool, str]:
    """(use the MXFP4 checkpoint for vLLM's own run, what the reader should expect), per host kind."""
    if kernel.runs:
        return True, ("vLLM's own MXFP4 kernel on the MXFP4 checkpoint: this host can run it "
                      f"({kernel.reason})")
    return False, ("expected on this host: vLLM alone refuses the MXFP4 checkpoint ('No MXFP4 MoE backend "
                   f"supports the deployment configuration'), because {kernel.reason.split(';')[0]}. So vLLM's "
                   "own method runs on the bf16 twin (the same expert weights, dequantised exactly) as the comparison; "
                   "on a host with AMX the installed tables keep vLLM's own MXFP4 kernel instead")


def _describe(title: str, result: RunResult) -> list[str]:
    lines = [f"{title}: {'ok' if result.ok else 'FAILED'} in {result.elapsed_s:.1f}s"]
    for worker, layers in zip(result.worker_pids or [0], result.worker_moe_layers):
        for info in layers:
            lines.append(f"  worker pid {worker}: {info.name} -> {info.quant_method}")
    decided = [ln.split("quantreg: ", 1)[1] for ln in result.log.splitlines() if "quantreg: (" in ln and "->" in ln]
    for line in sorted(set(decided)):
        lines.append(f"  log: quantreg: {line}")
    lines.append(f"  token ids: {result.token_ids}")
    if not result.ok:
        lines.append(f"  error: {(result.error or result.log[-2000:]).strip().splitlines()[-1]}")
    return lines


def run_demo(keep: str | None = None, as_json: bool = False) -> int:
    out: list[str] = []

    def stop(problem: str, path: str | None = None, registry: Registry | None = None, code: int = 1) -> int:
        """One ``quantreg demo: ...`` line; with ``--json`` the answer too (the envelope), never a bare exit."""
        if as_json:
            found = [*(registry.faults if registry is not None else ()), problem_json(problem, path=path)]
            print(json.dumps({"ok": False, "text": out, **envelope(found, registry)}, indent=2))
        print(f"quantreg demo: {problem}", file=sys.stderr)
        return code

    if keep is not None:  # the one writer's check, before torch: an existing directory is kept and added to
        refused = dir_target_problem(keep, force=True)
        if refused is not None:
            return stop(f"--keep {printable(keep) or repr(keep)}: {refused}", path=keep, code=2)
    from ..tiny.checkpoint import write_tiny_gpt_oss  # torch (after the checks of what was asked)

    try:
        work = make_directory(keep) if keep else fresh_directory("quantreg-demo-")
    except WriteRefused as exc:
        return stop(f"--keep {exc}", path=keep, code=2)

    def say(text: str = "") -> None:
        out.append(text)
        if not as_json:
            print(text, flush=True)

    model = write_tiny_gpt_oss(work / "tiny-gpt-oss-mxfp4")
    table = work / "demo-table.yaml"
    replace_file(table, DEMO_TABLE)
    say(f"checkpoint: {model}  (GPT-OSS, MXFP4 experts, 2 MoE layers, 4 experts, top-2)")
    key = Key("gpt_oss_mxfp4", "gpt_oss", guess_device())

    default = Registry.build()
    demo = Registry.build(config=[table])
    say("\n== explain with the installed tables ==")
    say(default.resolve(key).render())
    say(f"\n== explain with the demo table ({table}) ==")
    say(demo.resolve(key).render())
    if demo.resolve(key).keeps_vllm:
        return stop("the demo table cannot select mxfp4_reference: is quantreg-hpu-mxfp4 installed? "
                    "(quantreg plugins)", path=str(table), registry=demo)

    kernel = vllm_cpu_mxfp4_kernel()
    installed = default.resolve(key)
    say(f"\n== which method serves the checkpoint with the installed tables: {installed.method} ==")
    say(f"  {installed.summary()}")
    for step in installed.chain:  # why: each entry of the winning rule's chain, as explain shows it
        say(f"  {'yes' if step.available else 'no '} {step.method}: {step.reason.split('. Installed here')[0]}")
    mxfp4_own, own_note = own_method_plan(kernel)
    common: dict[str, Any] = {"max_tokens": MAX_TOKENS, "probe_tokens": PROBE_TOKENS,
                              "env": {settings.CONFIG: ""}}
    started = time.monotonic()

    def heartbeat(elapsed: float) -> None:
        if not as_json:
            print(f"  ... vLLM still running ({time.monotonic() - started:.0f} s; a start takes 30-60 s, "
                  "up to ~3 min on a loaded machine)", flush=True)

    first: tuple[str, Path, dict[str, Any]]
    second: tuple[str, Path, dict[str, Any]]
    if mxfp4_own:  # AMX: the installed tables keep vLLM's kernel; compare with the demo table's reference
        say(f"\n== running vLLM twice (default multiprocessing, side by side): {own_note}; and the demo "
            "table (mxfp4_reference) via additional_config ==")
        first = ("installed tables", model, {})
        second = ("demo table", model, {"additional_config": {"quantreg": {"config": [str(table)]}}})
    else:  # no AMX: the installed tables serve MXFP4 with a quantreg method; compare with vLLM on bf16
        say(f"\n== running vLLM twice (default multiprocessing, side by side): the installed tables on the "
            f"MXFP4 checkpoint ({installed.method}); and {own_note} ==")
        first = ("installed tables", model, {})
        second = ("vLLM's own method, bf16 twin", write_tiny_gpt_oss(work / "tiny-gpt-oss-bf16", mxfp4=False), {})
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(run_vllm, path, DEMO_PROMPTS, workdir=work / f"run-{i}",
                               progress=heartbeat if i == 0 else None, **common, **extra)
                   for i, (_, path, extra) in enumerate((first, second))]
        own, routed = (f.result() for f in futures)
    for line in _describe(first[0], own) + _describe(second[0], routed):
        say(line)
    compared = "vllm" if not mxfp4_own else demo.resolve(key).method  # the second run's method
    stated = stated_error(default, installed.method) + stated_error(demo if mxfp4_own else default, compared)
    lp, moe = _max_logprob_diff(own, routed), _max_moe_diff(own, routed, stated)
    say(f"\nmax |logprob difference| (same token, same step): {lp if lp is None else f'{lp:.4f}'}")
    say(f"max |MoE output difference| on a fixed {PROBE_TOKENS}-token input: "
        f"{'n/a' if moe is None else f'{moe[0]:.4f}'}")
    ok, line = verdict(own, routed, lp, moe)
    say(f"\n{line}")
    if as_json:
        print(json.dumps({
            "ok": ok, "key": key.as_json(), "work": str(work),
            "explain_default": default.resolve(key).to_json(), "explain_demo": demo.resolve(key).to_json(),
            "runs": {name: {"ok": r.ok, "elapsed_s": r.elapsed_s, "token_ids": r.token_ids,
                            "moe_methods": r.moe_quant_methods, "worker_pids": r.worker_pids}
                     for name, r in (("installed_tables", own), ("comparison", routed))},
            "max_logprob_diff": lp, "max_moe_output_diff": None if moe is None else moe[0],
            "max_moe_output_bound": None if moe is None else moe[1], "logprob_bound": LOGPROB_BOUND,
            "vllm_cpu_mxfp4_kernel": kernel.as_json(), "verdict": line, "text": out,
            **envelope(None, default),
        }, indent=2))
    return 0 if ok else 1
