"""Methods defined inside a user table (``methods:``), and the opt-in that guards them.

A table-defined method names arbitrary importable code, so it is refused unless the same table
says ``allow_import_targets: true``, and only user and run tables may do it: the default table
and plugin tables cannot smuggle targets in (plugins register methods through their hook).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..keys import EXPERTS, LAYER_KINDS, WILDCARD
from ..methods import EXPERT_LAYOUTS, Method, host_requirements_problem, keeps_vllm, valid_name, valid_target
from ..problems import did_you_mean

METHOD_KEYS = ("target", "devices", "requires", "options", "description", "expert_layout", "host", "layers")

Fail = Callable[[int | None, str, str], None]


def _strings(value: Any, fail: Fail, line: int | None, where: str) -> tuple[str, ...] | None:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    fail(line, where, "expected a string or a list of strings")
    return None


def parse_methods(raw: Any, *, line: int | None, allowed: bool, user_tier: bool, plugin_name: str,
                  fail: Fail) -> tuple[Method, ...]:
    """Check a ``methods:`` mapping; every fault goes to ``fail(line, key, message)``."""
    if not user_tier:
        fail(line, "methods", "only user and run tables may define methods; plugins use the register_methods hook")
        return ()
    if not allowed:
        fail(line, "methods", "table-defined methods import code named in the table: set "
                              "'allow_import_targets: true' in this table to allow them")
        return ()
    if not isinstance(raw, dict):
        fail(line, "methods", "expected a mapping of method name -> {target: 'package.module:Class', ...}")
        return ()
    key_lines: dict[Any, int] = getattr(raw, "key_lines", {})
    out: list[Method] = []
    for name, spec in raw.items():
        where, mline = f"methods.{name}", key_lines.get(name, line)
        if not valid_name(name) or keeps_vllm(name):
            fail(mline, where, "method names are letters, digits, '_', '.', '-' (and 'vllm' is built in)")
            continue
        if not isinstance(spec, dict):
            fail(mline, where, "expected a mapping with 'target'")
            continue
        spec_lines: dict[Any, int] = getattr(spec, "key_lines", {})
        for k in spec:
            if k not in METHOD_KEYS:
                fail(spec_lines.get(k, mline), f"{where}.{k}",
                     f"unknown key{did_you_mean(str(k), METHOD_KEYS)} (expected one of: {', '.join(METHOD_KEYS)})")
        target = spec.get("target")
        if not valid_target(target):
            fail(spec_lines.get("target", mline), f"{where}.target", "expected 'package.module:Class'")
            continue
        devices = _strings(spec.get("devices", WILDCARD), fail, spec_lines.get("devices"), f"{where}.devices")
        requires = _strings(spec.get("requires", []), fail, spec_lines.get("requires"), f"{where}.requires")
        options = spec.get("options")
        opts = None if options is None else _strings(options, fail, spec_lines.get("options"), f"{where}.options")
        host = _strings(spec.get("host", []), fail, spec_lines.get("host"), f"{where}.host")
        bad_host = host_requirements_problem(host) if host is not None else None
        if bad_host:
            fail(spec_lines.get("host", mline), f"{where}.host", bad_host.removeprefix("host "))
            continue
        description = spec.get("description", "")
        if not isinstance(description, str):
            fail(spec_lines.get("description"), f"{where}.description", "expected a string")
            continue
        layout = spec.get("expert_layout")
        if layout is not None and layout not in EXPERT_LAYOUTS:
            fail(spec_lines.get("expert_layout"), f"{where}.expert_layout",
                 f"expected one of {', '.join(EXPERT_LAYOUTS)}{did_you_mean(str(layout), EXPERT_LAYOUTS)}")
            continue
        layers = _strings(spec.get("layers", [EXPERTS]), fail, spec_lines.get("layers"), f"{where}.layers")
        if layers is not None and (not layers or any(k not in LAYER_KINDS for k in layers)):
            fail(spec_lines.get("layers", mline), f"{where}.layers",
                 f"expected a non-empty list of {', '.join(LAYER_KINDS)}")
            continue
        if (devices is None or requires is None or host is None or layers is None
                or (options is not None and opts is None)):
            continue
        out.append(Method(name=name, target=target, devices=devices, requires=requires, options=opts,
                          description=description, expert_layout=layout, host=host, layers=layers,
                          plugin=plugin_name))
    return tuple(out)
