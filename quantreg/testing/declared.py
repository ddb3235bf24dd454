"""Checks of what quantreg and vLLM's seam read off a method before any layer runs.

``registered``, ``subclass``, ``declarations``, ``probe``, ``options`` and ``unknown-options``:
the registration, the class behind the target, the declared devices / requirements / options /
tolerance, the availability probe, and construction with the options tables pass (and with one
no table may pass). None of them touches a device's kernels, so they run on any machine.
"""

from __future__ import annotations

import re
import time
from typing import Any

from ..keys import WILDCARD
from ..methods import load_object, run_probe
from ..problems import describe
from ..registry import Registry
from ..version_spec import check_specifier
from .context import Context, fail, skip

UNKNOWN_OPTION = "quantreg_conformance_unknown_option"
_DEVICE_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def registered(ctx: Context) -> None:
    """The method was found (:func:`quantreg.testing.api.run_checks` reports the case where it was not)."""
    ctx.passed(f"by plugin '{ctx.method.plugin or '?'}' as {ctx.method.target}")


def subclass(ctx: Context) -> None:
    """Import the target; it must be a ``FusedMoEMethodBase`` subclass (sets ``ctx.cls``)."""
    m = ctx.method
    base = ctx.fused_moe_base
    assert base is not None  # Need.VLLM
    try:
        obj = load_object(m.target)
    except Exception as exc:
        if not ctx.availability.ok:
            ctx.blocked = (f"cannot import {m.target} ({describe(exc, located=True)}); "
                           f"'{m.name}' is not available on {ctx.device}: {ctx.availability.reason}")
            raise skip(ctx.blocked) from exc
        ctx.blocked = f"its target {m.target} does not import"
        raise fail(f"importing {m.target} failed although the method is available here: "
                   f"{describe(exc, located=True)}") from exc
    if not isinstance(obj, type):
        ctx.blocked = f"its target {m.target} is not a class"
        raise fail(f"{m.target} is a {type(obj).__name__}, not a class")
    if not issubclass(obj, base):
        ctx.blocked = f"{m.target} is not a FusedMoEMethodBase"
        bases = ", ".join(f"{b.__module__}.{b.__qualname__}" for b in obj.__mro__[1:-1]) or "object"
        raise fail(f"{m.target} derives from {bases}; vLLM's seam only accepts subclasses of "
                   "vllm.model_executor.layers.fused_moe.FusedMoEMethodBase")
    ctx.cls = obj
    ctx.passed(f"{obj.__module__}.{obj.__qualname__} <- "
               + " <- ".join(b.__qualname__ for b in obj.__mro__[1:] if issubclass(b, base)))


def declarations(ctx: Context) -> None:
    """The :class:`Method` fields, and ``quantreg_tolerance`` when another check loaded the class."""
    m = ctx.method
    problems = []
    if not m.devices:
        problems.append("devices is empty: name the devices it runs on, or ('*',) for any")
    for d in m.devices:
        if d != WILDCARD and not _DEVICE_RE.match(d):
            problems.append(f"device {d!r} is not a vLLM device type such as 'cpu', 'cuda', 'hpu'")
    for r in m.requires:
        if not isinstance(r, str) or not _MODULE_RE.match(r):
            problems.append(f"requires entry {r!r} is not a module name")
    if m.options is None:
        problems.append("options is None (accepts anything): declare the option names, () for none, so a "
                        "table with a misspelt option is rejected when it is loaded, not when vLLM builds "
                        "the model")
    if m.vllm_version and (bad := check_specifier(m.vllm_version)):
        problems.append(f"vllm_version: {bad}")
    if (bad_tolerance := ctx.declared_tolerance()[1]) is not None:
        problems.append(bad_tolerance)
    if problems:
        raise fail("; ".join(problems))
    probe = m.probe if isinstance(m.probe, str) or m.probe is None else getattr(m.probe, "__qualname__", "?")
    ctx.passed(f"devices {', '.join(m.devices)}; requires {', '.join(m.requires) or 'nothing'}; "
               f"probe {probe or 'none (devices and requires decide)'}; "
               f"options {', '.join(m.options or ()) or 'none'}"
               + (f"; vLLM {m.vllm_version}" if m.vllm_version else ""))


def probe(ctx: Context) -> None:
    """The probe answers ``(bool, non-empty str)`` within the budget and does not raise.

    It runs in quantreg's own probe thread (:func:`quantreg.methods.run_probe`); what it
    returned or raised is kept as is, because resolution forgives what this check must report.
    """
    m = ctx.method
    if m.probe is None:
        here = "available" if ctx.availability.ok else "not available"
        ctx.passed(f"no probe: devices and requires decide ({here} on {ctx.device})")
        return
    target = m.probe
    answer: dict[str, Any] = {}

    def call() -> tuple[bool, str]:
        try:
            answer["value"] = (load_object(target) if isinstance(target, str) else target)()
        except BaseException as exc:
            answer["error"] = exc
        return True, "answered"

    start = time.monotonic()
    answered = run_probe(call, ctx.probe_budget).ok
    elapsed = time.monotonic() - start
    if not answered:
        raise fail(f"no answer within {ctx.probe_budget:g} s; quantreg calls the probe while vLLM builds "
                   "the model, so it must answer quickly (check for the device, do not initialise it)")
    if "error" in answer:
        raise fail(f"raised {describe(answer['error'], located=True)}; a probe must return (False, reason) "
                   "instead of raising")
    value = answer.get("value")
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], bool)
            and isinstance(value[1], str)):
        raise fail(f"returned {value!r}; a probe returns (ok: bool, reason: str)")
    if not value[1].strip():
        raise fail("returned an empty reason; `quantreg explain` shows it to users")
    ctx.passed(f"answered in {elapsed * 1000:.0f} ms: ({value[0]}, {value[1]!r})")


def rule_option_sets(registry: Registry | None, name: str) -> list[tuple[str, dict[str, Any]]]:
    """``(where, options)`` to build the method with: none, then each rule naming it that passes options."""
    sets: list[tuple[str, dict[str, Any]]] = [("no options", {})]
    if registry is None:
        return sets
    for rule in registry.index.rules:
        if name in rule.methods and rule.options:
            opts = dict(rule.options)
            if all(opts != seen for _, seen in sets):
                sets.append((f"rule {rule.location}", opts))
    return sets


def options(ctx: Context) -> None:
    """``cls(moe_config, **options)`` builds with no options and with every rule's options."""
    cls = ctx.cls
    assert cls is not None  # Need.CLASS
    sets = rule_option_sets(ctx.registry, ctx.method.name)
    sets += [("the caller", o) for o in ctx.extra_option_sets]
    config = ctx.harness.moe_config()
    built: list[str] = []
    for where, opts in sets:
        try:
            with ctx.harness.context():
                cls(config, **opts)
        except Exception as exc:
            refused = ctx.refused_here(exc)
            if refused is not None and not built:  # it builds nothing here: the options are checked where it runs
                raise refused from exc
            raise fail(f"{cls.__name__}(moe_config, **{opts!r}) (options from {where}) raised "
                       f"{describe(exc, located=True)}; every option must have a default, and every option "
                       "a rule passes must build") from exc
        built.append(f"{where}: {opts}" if opts else where)
    ctx.passed(f"built with {'; '.join(built)}")


def unknown_options(ctx: Context) -> None:
    """An option no table may pass is rejected, naming it (a misspelt option must not be ignored)."""
    cls = ctx.cls
    assert cls is not None  # Need.CLASS
    config = ctx.harness.moe_config()
    try:
        with ctx.harness.context():
            cls(config, **{UNKNOWN_OPTION: 1})
    except Exception as exc:
        message = str(exc)
        if UNKNOWN_OPTION not in message:
            raise fail(f"rejected {UNKNOWN_OPTION}=1 with {describe(exc, located=True)}, which does not "
                       "name the option; say which option is unknown (and which are accepted)") from exc
        ctx.passed(f"{type(exc).__name__}: {message.splitlines()[0] if message else ''}")
        return
    raise fail(f"{cls.__name__}(moe_config, {UNKNOWN_OPTION}=1) was accepted; a misspelt rule option "
               "would be silently ignored. Raise TypeError naming the unknown option(s)")
