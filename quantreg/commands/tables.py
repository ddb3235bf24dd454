"""The commands that answer from the rule tables: ``list``, ``plugins``, ``rules``, ``explain``, ``validate``.

Each builds the registry a vLLM start-up with the same environment would build
(:func:`quantreg.output.registry_for`) and answers through :func:`quantreg.output.respond`, so a
fault a start-up would refuse on is reported the same way by every one of them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from .. import host, keys, settings
from ..envelope import envelope
from ..keys import Key
from ..loading import config_paths, load_tables, option_value_problems
from ..output import emit, plugin_output_to_stderr, registry_for, respond, warn_faults
from ..problems import printable
from ..registry import Registry
from ..table import cache as tablecache
from ..table.file import Tier, rule_json


def cmd_list(args: argparse.Namespace) -> int:
    registry = registry_for(args)
    warn_faults(registry)
    named = device_warnings(registry, [args.device])
    for warning in named:
        print(f"warning: {warning}", file=sys.stderr)
    device = args.device or host.guess_device()
    rows: list[dict[str, Any]] = []
    for m in sorted(registry.methods.values(), key=lambda m: m.name):
        with plugin_output_to_stderr():  # probes are plugin code too
            avail = registry.availability(m.name, device)
        rows.append({"name": m.name, "plugin": m.plugin, "target": m.target, "devices": list(m.devices),
                     "device": device, "available": avail.ok, "reason": avail.reason, "description": m.description})
    width = max([len(r["name"]) for r in rows] + [4])
    lines = [f"methods available on {device}:"]
    for r in rows:
        mark = "yes" if r["available"] else "no "
        lines.append(f"  {mark} {r['name']:<{width}}  {r['plugin']}  {r['target']}  devices={','.join(r['devices'])}"
                     f"  ({r['reason']})")
    return respond(args, registry, {"methods": rows, "key_warnings": named}, lines)


def cmd_plugins(args: argparse.Namespace) -> int:
    registry = registry_for(args)
    rows = [p.__dict__ for p in registry.plugin_infos]
    failures = [str(f) for f in registry.failures]
    lines = [printable(f"  {p['status']:<8} {p['name']}  ({p['distribution']} {p['version']}) {p['reason']}").rstrip()
             for p in rows]
    lines += [f"  fault    {printable(f)}" for f in failures]
    return respond(args, registry, {"plugins": rows, "faults": failures}, ["plugins:", *lines])


def cmd_rules(args: argparse.Namespace) -> int:
    registry = registry_for(args)
    warn_faults(registry)
    rules = sorted(registry.index.rules, key=lambda r: tuple(-x for x in r.rank))
    lines = ["effective rules, highest precedence first:"]
    for r in rules:
        lines.append(f"  {r.location}  [{r.tier_label}, specificity {r.match.specificity}, priority {r.priority}]  "
                     f"{r.match} -> {' | '.join(r.methods)}" + (f"  options={dict(r.options)}" if r.options else ""))
    return respond(args, registry, {"rules": [rule_json(r) for r in rules]}, lines)


def cmd_explain(args: argparse.Namespace) -> int:
    from ..answer import answer, refused_notes  # the one computation every tool answers a key from

    registry = registry_for(args)
    warn_faults(registry)
    with plugin_output_to_stderr():  # resolving runs probes, findings run plugin code
        ans = answer(registry, Key(args.quant_format, args.model_type, args.device, args.layer,
                                   **{k.name: getattr(args, f"key_{k.name}") for k in keys.MATCH_KEYS}))
    for fault in ans.problems:
        print(f"warning: {fault}", file=sys.stderr)
    decision = ans.decision
    numerics = _numerics(registry, decision)
    lines = [decision.render(), *(f"numerics {name}: {text}" for name, text in numerics.items()),
             *(f"{f.level:<8} {f}" for f in ans.findings)]
    deprecations = [str(p) for h in registry.headers for p in h.deprecations]
    lines += [f"deprecated {printable(d)}" for d in deprecations]  # old spellings the tables still use
    # a chosen method that declares it cannot take the rule's options: name what serves instead (issue 53)
    lines += [f"warning  {n}" for s in decision.sides for n in refused_notes(registry, s.decision)]
    if ans.vllm_limitation:  # "vLLM's own method will fail for this key here": last, where the eye lands
        said = [n for n in ans.notes if n.startswith("vLLM's own method will fail")]  # each reason once
        lines.append(f"warning  {said[-1] if said else ans.vllm_limitation}")
    named = _key_warnings(registry, decision.key)
    for warning in named:
        print(f"warning: {warning}", file=sys.stderr)
    return respond(args, registry, {**decision.to_json(), **ans.to_json(), "key_warnings": named,
                                    "deprecations": deprecations, "numerics": numerics}, lines, decision)


def _numerics(registry: Registry, decision: Any) -> dict[str, str]:
    """What each chosen method rounds, per what block (its registration's ``numerics``), by method name:
    the price of a fast method printed beside its name (issue 54). Methods that declare none are left out."""
    chosen = [side.decision.method for side in decision.split] if decision.split else [decision.method]
    out: dict[str, str] = {}
    for name in chosen:
        method = registry.methods.get(name)
        if method is not None and method.numerics and name not in out:
            out[name] = method.numerics
    return out


def _key_warnings(registry: Registry, key: Key) -> list[str]:
    """Did-you-mean warnings for a key part vLLM never uses (:mod:`quantreg.vllm.names`)."""
    from ..vllm.names import key_warnings, known_names

    formats, devices = known_names(registry)
    return key_warnings(key, formats, devices)


def device_warnings(registry: Registry, devices: Sequence[str | None]) -> list[str]:
    """Did-you-mean warnings for ``--device`` values vLLM never reports (``gpu``: vLLM says ``cuda``)."""
    from ..vllm.names import device_warning, known_names

    known = known_names(registry)[1]
    return [f"--device {printable(d)}: {w}" for d in devices if d and (w := device_warning(d, known))]


def _match_warnings(registry: Registry, tables: Sequence[Any]) -> list[str]:
    """Located warnings for match values of ``tables`` that vLLM never puts in a key (not errors: a
    plugin's platform may use a name quantreg does not know)."""
    from ..vllm.names import device_warning, format_warning, known_names

    formats, devices = known_names(registry, (Tier.PLUGIN, Tier.DEFAULT))
    out = []
    for table in tables:
        for rule in table.rules:
            model_types = rule.match.model_type or (None,)
            for value in rule.match.quant_format or ():
                for model_type in model_types:
                    why = format_warning(value, model_type, formats)
                    if why:
                        out.append(f"{printable(rule.path)}:{rule.line}: match.quant_format: {why}")
                        break
            for value in rule.match.device or ():
                why = device_warning(value, devices)
                if why:
                    out.append(f"{printable(rule.path)}:{rule.line}: match.device: {why}")
    return out



def cmd_validate(args: argparse.Namespace) -> int:
    with tablecache.bypass():  # validate always parses the files themselves, never a cached parse
        return _validate(args)


def _validate(args: argparse.Namespace) -> int:
    registry = registry_for(args)
    if args.files:
        tables, headers, found = load_tables([(f, Tier.USER) for f in args.files], registry.methods)
        problems: list[Any] = list(found)
        checked = list(args.files)
    else:
        tables = [t for t in registry.tables if t.tier not in (Tier.PLUGIN, Tier.DEFAULT)]
        headers = list(registry.headers)
        problems = list(registry.faults)
        checked = [t.path for t in registry.tables]
    known = {**registry.methods, **{m.name: m for t in tables for m in t.methods}}
    problems += [p for t in tables for p in option_value_problems(t, known)]  # refused at construction otherwise
    deprecations = [str(p) for h in headers for p in h.deprecations]
    faults = [str(p) for p in problems]
    warnings = _match_warnings(registry, tables)
    if not faults:  # which installed plugin rules these tables take keys from (or give them to), once
        with plugin_output_to_stderr():  # the files in the tier they were checked in (user), as a start-up reads them
            together = Registry.build(config=args.config, env={
                **os.environ, settings.CONFIG: os.pathsep.join([*config_paths(os.environ), *args.files])}) \
                if args.files else registry
        names = [str(f) for f in (args.files or [t.path for t in tables])]
        warnings += [c for c in together.collisions() if any(n in c for n in names)]
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    text = "\n".join([*faults] if faults else [f"ok: {len(checked)} table(s) valid"])
    text += "".join(f"\ndeprecated {printable(d)}" for d in deprecations)  # read the same; the new spelling named
    emit(args, {"ok": not faults, "files": checked, "warnings": warnings, "deprecations": deprecations,
                 **envelope(problems, registry, args.config)}, text)
    return 1 if faults else 0
