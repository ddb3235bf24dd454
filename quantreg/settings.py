"""The one table of quantreg's ``QUANTREG_*`` environment settings: name, parser, default, help.

Why one table: the settings used to be declared across eleven modules, some twice with two
different messages and one documented nowhere. Every reader asks :func:`raw` or :func:`value`
here (a test walks the code for any other spelling of a ``QUANTREG_`` name), multinode
shipping asks :func:`shipped_names`, ``doctor``/``explain`` report :func:`problems`, and the docs
test checks that every name of :data:`SETTINGS` is documented in ``docs/operating.md``.

A parser never raises: it returns ``(value, None)`` or ``(default, message)``; the message
becomes one located problem ``environment: NAME: message`` (lenient: the default is used).

Plugins own their own ``QUANTREG_<PLUGIN>_*`` names (e.g. ``QUANTREG_MYPLUGIN_ISA``): a
``QUANTREG_`` name not in this table is not an error.

This module imports nothing heavy: it is read on every vLLM start-up.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

PREFIX = "QUANTREG_"
ENVIRONMENT = "environment"
"""The ``path`` of a problem about a setting; its ``key`` is the setting's name."""

CONFIG = "QUANTREG_CONFIG"
STRICT = "QUANTREG_STRICT"
DECISIONS = "QUANTREG_DECISIONS"
CACHE_DIR = "QUANTREG_CACHE_DIR"
PLUGINS = "QUANTREG_PLUGINS"
DISABLE_PLUGINS = "QUANTREG_DISABLE_PLUGINS"
PROBE_TIMEOUT = "QUANTREG_PROBE_TIMEOUT"
PLUGIN_IMPORT_TIMEOUT = "QUANTREG_PLUGIN_IMPORT_TIMEOUT"
MXFP4_COMPILE = "QUANTREG_MXFP4_COMPILE"
HOST_CPU_FLAGS = "QUANTREG_HOST_CPU_FLAGS"
FINGERPRINT = "QUANTREG_FINGERPRINT"
RUN_FINGERPRINT = "QUANTREG_RUN_FINGERPRINT"
TABLES = "QUANTREG_TABLES"
SERVE_TIMEOUT = "QUANTREG_SERVE_TIMEOUT"
HIDE_AMX = "QUANTREG_HIDE_AMX"
SPLIT_MEMORY_RESERVE = "QUANTREG_SPLIT_MEMORY_RESERVE"

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("", "0", "false", "no", "off")
MXFP4_COMPILE_MODES = ("auto", "0", "1")
MIN_TIMEOUT = 0.01
#: ``threading`` refuses longer waits with ``OverflowError``; kept here so no import of threading is needed.
TIMEOUT_MAX = 9223372036.0
SHOWN = 40
"""Most characters of a bad value quoted in a message."""

Parsed = tuple[Any, "str | None"]


def shown(raw: str) -> str:
    """A bad value as a message quotes it: cut to :data:`SHOWN` characters, escaped by ``!r``."""
    return repr(raw if len(raw) <= SHOWN else raw[:SHOWN - 3] + "...")


def parse_text(raw: str, default: Any) -> Parsed:
    return raw, None


def parse_flags(raw: str, default: Any) -> Parsed:
    """``QUANTREG_HOST_CPU_FLAGS``: empty is unset; text with no flag in it (``","``) is a problem, never "no flags"."""
    if not raw.strip():
        return default, None
    if not raw.replace(",", " ").split():
        return default, (f"expected CPU flags (a list such as 'avx2,fma', or +flag/-flag edits), got "
                         f"{raw[:40]!r}, which names none; ignored: this host's real flags are used")
    return raw, None


def parse_paths(raw: str, default: Any) -> Parsed:
    return tuple(p for p in raw.split(os.pathsep) if p.strip()), None


def parse_path(raw: str, default: Any) -> Parsed:
    return (raw.strip() or None), None


def parse_names(raw: str, default: Any) -> Parsed:
    return frozenset(n.strip() for n in raw.split(",") if n.strip()), None


def parse_strict(raw: str, default: Any) -> Parsed:
    """True/false words; anything else counts as strict (a misspelt value must not lose strict)."""
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True, None
    if word in FALSE_WORDS:
        return False, None
    lenient = ", ".join(w for w in FALSE_WORDS if w)
    return True, (f"{shown(raw)} is not one of {', '.join(TRUE_WORDS)} (strict) or {lenient} (lenient); "
                  "counted as strict")


def _number(raw: str) -> float:
    """``raw`` as a float, NaN when it is not one (the number parsers refuse NaN with their own message)."""
    try:
        return float(raw)
    except ValueError:
        return math.nan


def parse_seconds(raw: str, default: Any) -> Parsed:
    """A positive number of seconds; huge values (``inf``) are clamped to what ``threading`` accepts."""
    seconds = _number(raw) if raw.strip() else default
    if math.isnan(seconds) or seconds <= 0:
        return default, (f"{shown(raw)} is not a positive number of seconds (e.g. 10, 0.5, inf); "
                         f"using the default {default:g}")
    return min(max(seconds, MIN_TIMEOUT), TIMEOUT_MAX), None


def parse_gib(raw: str, default: Any) -> Parsed:
    """A non-negative, finite number of GiB (``0`` turns the check it bounds off)."""
    gib = _number(raw) if raw.strip() else default
    if not math.isfinite(gib) or gib < 0:
        return default, (f"{shown(raw)} is not a non-negative number of GiB (e.g. 4, 0.5, 0); "
                         f"using the default {default:g}")
    return gib, None


def parse_compile(raw: str, default: Any) -> Parsed:
    word = raw.strip().lower() or "auto"
    if word in MXFP4_COMPILE_MODES:
        return word, None
    return default, f"{shown(raw)} is not one of {', '.join(MXFP4_COMPILE_MODES)}"


def parse_cache_dir(raw: str, default: Any) -> Parsed:
    return (None if raw.strip().lower() in ("", "off", "0", "none") else raw), None


@dataclass(frozen=True)
class Setting:
    """One ``QUANTREG_*`` variable: how it is read, what it is when unset, and what it is for."""

    name: str
    parser: Callable[[str, Any], Parsed]
    default: Any
    help: str
    ships: bool = True
    """Copied to workers on other nodes by :mod:`quantreg.vllm.multinode` (all of them do today)."""


SETTINGS: tuple[Setting, ...] = (
    Setting(CONFIG, parse_paths, (), "User rule tables, os.pathsep-separated; they beat the default and "
                                     "plugin tables."),
    Setting(STRICT, parse_strict, False, "1/true/yes/on: every fault is fatal at vLLM start-up; 0/false/no/off or "
                                         "empty: lenient. Any other value is a problem and counts as strict."),
    Setting(DECISIONS, parse_path, None, "A JSONL file: every vLLM process appends one line per decided key "
                                         "(the decisions trail, strict JSON; regular files only)."),
    Setting(CACHE_DIR, parse_cache_dir, "", "Where parsed tables are cached (default $XDG_CACHE_HOME/quantreg); "
                                            "off/0/none disables the cache."),
    Setting(PLUGINS, parse_names, None, "Comma-separated plugin entry-point names: only these plugins load."),
    Setting(DISABLE_PLUGINS, parse_names, frozenset(), "Comma-separated plugin entry-point names that do not load."),
    Setting(PROBE_TIMEOUT, parse_seconds, 10.0, "Seconds a method's availability probe (or a plugin check) may "
                                                "take before it counts as unavailable."),
    Setting(PLUGIN_IMPORT_TIMEOUT, parse_seconds, 10.0, "Seconds a plugin's import or hook may take; past it that "
                                                        "plugin is dropped with a warning."),
    Setting(MXFP4_COMPILE, parse_compile, "auto", "auto/0/1: whether the MXFP4 reference method uses its "
                                                  "torch.compile'd kernel (auto: where it pays off)."),
    Setting(SPLIT_MEMORY_RESERVE, parse_gib, 4.0, "GiB of memory (MemAvailable) a tokens: split must leave free "
            "after keeping or copying a layer's weights for its other side; below it that layer's split is dropped "
            "(lenient: WARNING, the first side serves every token count; strict: refused). 0: no check."),
    Setting(HOST_CPU_FLAGS, parse_flags, None, "Test seam: replace (a list) or edit (+flag/-flag) the CPU flags "
                                              "quantreg reads from /proc/cpuinfo."),
    Setting(FINGERPRINT, parse_text, None, "Set by the first vLLM process: its table fingerprint, which later "
                                           "processes compare with their own."),
    Setting(RUN_FINGERPRINT, parse_text, None, "Set by EngineCore: the fingerprint of the table with the run's "
                                               "additional_config, compared by every Worker."),
    Setting(TABLES, parse_text, None, "Set by the driver: its user tables (paths, sha256, text) for workers on "
                                      "nodes without the files."),
    Setting(SERVE_TIMEOUT, parse_seconds, 300.0, "Kit: seconds quantreg.testing.serving waits for a test server's "
                                                 "/health."),
    Setting(HIDE_AMX, parse_text, None, "Kit: 1 in a vLLM child's environment (quantreg.testing.host_kind) hides "
                                        "AMX from vLLM, so an AMX host shows the other kind's branch."),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def raw(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The unparsed value of setting ``name`` (``None`` when unset): the one read of the environment."""
    if name not in BY_NAME:
        raise KeyError(f"{name} is not a quantreg setting (see quantreg.settings.SETTINGS)")
    return (os.environ if env is None else env).get(name)


def parsed(name: str, env: Mapping[str, str] | None = None) -> Parsed:
    """``(value, problem message or None)`` of setting ``name``; unset is its default, no problem."""
    setting = BY_NAME[name]
    text = raw(name, env)
    if text is None:
        return setting.default, None
    return setting.parser(text, setting.default)


def value(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The parsed value of setting ``name`` (its default when unset or unreadable)."""
    return parsed(name, env)[0]


def problems(env: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """``(name, message)`` for every setting whose value its parser refused, in table order."""
    found = []
    for setting in SETTINGS:
        message = parsed(setting.name, env)[1]
        if message is not None:
            found.append((setting.name, message))
    return found


def shipped_names() -> tuple[str, ...]:
    """The settings multinode shipping copies to other nodes."""
    return tuple(s.name for s in SETTINGS if s.ships)
