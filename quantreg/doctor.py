"""``quantreg doctor``: versions, device, plugins, start-up hook, tables, what this host passes over, warnings.

Why a module of its own: ``doctor`` gathers from every part (installed software, the host, the
registry's chains and dense rules, the kit's compiled record, a decisions trail) and was half of
:mod:`quantreg.cli`; the command line keeps only its wiring (:func:`quantreg.cli.cmd_doctor`).
"""

from __future__ import annotations

import argparse
from typing import Any

from . import installed, settings
from .envelope import left_out, left_out_lines
from .host import host_facts
from .keys import EXPERTS, Key
from .methods import VLLM_METHOD
from .output import plugin_output_to_stderr, registry_for, respond
from .problems import printable
from .registry import Registry

FINGERPRINT_COVERS = ("plugins, QUANTREG_CONFIG and --config tables; a run's additional_config tables count "
                      "only when given here as --config")


def doctor(args: argparse.Namespace) -> int:
    from .vllm import versions  # pure Python, imports no vLLM

    registry = registry_for(args)
    vllm = installed.vllm_distribution()
    if vllm:
        from .vllm.platform import vllm_device  # doctor asks vLLM itself (slow: imports it)

        device, how = vllm_device()
    else:
        device, how = None, "vLLM is not installed"
    hook_ok, hook_reason = installed.startup_hook_status()
    mode = registry.mode()
    warnings: list[str] = [str(f) for f in registry.faults]
    with plugin_output_to_stderr():  # plugins speak for their devices (doctor_findings hook)
        findings = registry.findings(device)  # what quantreg.answer gives explain and plan too
    warnings += [str(f) for f in findings if f.level != "info"]
    if vllm and not hook_ok:
        warnings.append(f"vLLM start-up hook: {hook_reason}")
    from .vllm_limits import vllm_cpu_mxfp4_kernel  # the one answer: doctor, demo, explain and plan agree

    kernel = vllm_cpu_mxfp4_kernel()
    untested = versions.check_tested(vllm[1]) if vllm else None  # the one declared range (no vLLM import)
    warnings += [untested] if untested else []
    shadow = installed.shadowing_copy()
    warnings += [shadow] if shadow else []
    warnings += registry.collisions()  # a rule taking keys another plugin's packaged rule would decide
    data: dict[str, Any] = {
        "versions": {n: installed.dist_version(n) for n in ("quantreg", "pluggy", "PyYAML", "torch")}
        | {"vllm": f"{vllm[0]} {vllm[1]}" if vllm else None},
        "device": device,
        "device_source": how,
        "startup_hook": {"ok": hook_ok, "detail": hook_reason},
        "plugins": [p.__dict__ for p in registry.plugin_infos],
        "tables": [{"path": t.path, "tier": str(t.tier), "rules": len(t.rules)} for t in registry.tables],
        "fingerprint": registry.fingerprint(),
        "vllm_cpu_mxfp4_kernel": kernel.as_json(),
        "fingerprint_covers": FINGERPRINT_COVERS,
        "strict": mode.strict,
        "vllm_tested_range": {"range": versions.TESTED, "releases": list(versions.TESTED_RELEASES),
                              "inside": None if not vllm else untested is None},
        "findings": [f.as_json() for f in findings],
        "warnings": warnings,
        "host": host_facts().as_json(),
    }
    with plugin_output_to_stderr():  # resolving runs probes
        passed = _passed_over(registry)
    data["passed_over"] = passed
    stale = [(r, s) for r in registry.index.rules for s in registry.stale_evidence(r)]  # quantreg.pins
    data["stale_tuned"] = [{"rule": r.location, "field": s.field, "recorded": s.recorded, "running": s.running}
                           for r, s in stale]
    warnings += [f"tuned rule {r.location} is stale: {s.text()}" for r, s in stale]
    with plugin_output_to_stderr():
        dense = _dense_decisions(registry, device)
    if dense:  # only with dense rules: every other doctor answer keeps its JSON
        data["dense"] = dense
    lines = ["versions:"] + [f"  {k:<9} {v or 'not installed'}" for k, v in data["versions"].items()]
    lines += [f"device:    {device or 'unknown'} ({how})", f"vLLM hook: {'ok' if hook_ok else 'NO'} ({hook_reason})",
              "plugins:"]
    lines += [printable(f"  {p.status:<8} {p.name} ({p.distribution} {p.version}) {p.reason}").rstrip()
              for p in registry.plugin_infos]
    lines += ["tables:"] + [f"  {t['tier']:<7} {t['path']} ({t['rules']} rules)" for t in data["tables"]]
    lines += left_out_lines(left_out(registry, args.config))
    advice = "" if kernel.runs else f". {registry.serving_advice(Key('gpt_oss_mxfp4', 'gpt_oss', 'cpu'))}"
    lines += [f"vLLM CPU MXFP4 kernel: {'yes' if kernel.runs else 'no'}: {kernel.reason}{advice}"
              + ("; amd-quark is installed, so vLLM's emulation backend can serve MXFP4" if kernel.emulation else "")]
    lines += [f"fingerprint: {data['fingerprint']} ({FINGERPRINT_COVERS})", f"mode: {mode}"]
    if vllm and not untested:
        lines.append(f"vLLM {vllm[1]} inside tested range {versions.TESTED} "
                     f"(tested: {', '.join(versions.TESTED_RELEASES)})")
    facts = data["host"]
    flags = ", ".join(facts["flags"]) or "none of note"
    lines.append(f"host:      {facts['kind']} CPU, {facts['cores']} cores, flags {flags}"
                 + (f" (simulated by {settings.HOST_CPU_FLAGS})" if facts["simulated"] else ""))
    for entry in passed:
        which = f" for tokens{entry['tokens']}" if "tokens" in entry else ""
        lines.append(f"chain:     {entry['key']} -> {entry['method']}{which} [{entry['rule']}]")
        lines += [f"  {step['method']}: passed over: {step['reason']}" for step in entry["passed_over"]]
    lines += [f"dense:     {d['key']} -> {d['method']} [{d['rule']}]" for d in dense]
    lines += _compiled_lines(registry, data)
    lines += [f"info: {f}" for f in findings if f.level == "info"]
    lines += [f"warning: {w}" for w in warnings]
    status = _doctor_decisions(args, data, lines)
    own = data.get("decisions", {}).get("problems", []) if status else []
    return max(status, respond(args, registry, data, lines, left_out_shown=True, problems=own))


def _compiled_lines(registry: Registry, data: dict[str, Any]) -> list[str]:
    """Per registered method: does it survive vLLM's default (compiled) mode? From the kit's last
    ``compiled`` check on this build (:mod:`quantreg.testing.compiled_record`; no torch, no vLLM here)."""
    from .testing.compiled_record import doctor_line, recorded

    seen = {m.name: recorded(m) for m in sorted(registry.methods.values(), key=lambda m: m.name)
            if m.name != VLLM_METHOD}
    data["compiled"] = seen
    return [doctor_line(registry.methods[name], verdict) for name, verdict in seen.items()]


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
        for kind in rule.match.layers:  # a dense rule's kinds too (issue 30)
            decision = registry.resolve(Key(named[0], named[1], named[2], kind))
            for side in decision.sides:  # every side of a split, each decided by its own rule
                one = side.decision
                if one.rule is rule and one.passed_over:
                    out.append({"key": str(decision.key), "method": one.method, "rule": one.source,
                                **({"tokens": str(side.tokens)} if decision.split else {}),
                                "passed_over": [{"method": s.method, "reason": s.reason} for s in one.passed_over]})
    return out


def _dense_decisions(registry: Registry, device: str | None) -> list[dict[str, str]]:
    """What the dense rules (issue 30) decide on this host: each dense kind a rule names, for every value
    of its match fields (a list-valued field gives one line per value; a wildcard quant format or model
    type is shown as ``*``, which the rule matches like any value; no device: the device doctor found)."""
    import itertools

    out: list[dict[str, str]] = []
    seen: set[Key] = set()
    for rule in registry.index.rules:
        if rule.match.layer is None:
            continue
        fields = (rule.match.quant_format, rule.match.model_type, rule.match.device or ((device,) if device else None))
        for values in itertools.islice(itertools.product(*(f or ("*",) for f in fields)), 64):
            for kind in rule.match.layers:
                key = Key(values[0], values[1], values[2], kind)
                if kind == EXPERTS or key in seen:
                    continue
                seen.add(key)
                decision = registry.resolve(key)
                out.append({"key": str(decision.key), "method": decision.method, "rule": decision.source})
    return out


def _doctor_decisions(args: argparse.Namespace, data: dict[str, Any], lines: list[str]) -> int:
    """``doctor --decisions FILE.jsonl``: summarise a ``QUANTREG_DECISIONS`` trail into ``data``/``lines``.

    Exit 1 when processes disagree (same key, different method or table fingerprint) or any
    ``verify:`` comparison exceeded its tolerance: those are the failures the trail exists to
    catch. Unreadable or cut-short lines are only warnings (a writer may still be appending); a
    trail file that cannot be read at all (missing, a directory) is exit 1 too: the user named it,
    and "0 line(s)" with exit 0 hid a wrong path.
    """
    if not args.decisions:
        return 0
    from .audit import summarise

    summary = summarise(args.decisions)
    data["decisions"] = summary.to_json()
    lines.append(summary.render())
    return 1 if summary.disagreements or summary.exceedances or not summary.readable else 0
