"""Plugin discovery and hook calls: pluggy, the ``quantreg`` entry-point group, allow/deny lists.

Each entry point is loaded and validated on its own, and each hook implementation is called on
its own, so a plugin that fails to import, misspells a hook or raises becomes a
:class:`PluginFailure` naming the plugin and the hook, and the other plugins keep working.

Plugin code runs inside every vLLM process, so everything it can do is contained here: any
exception, ``SystemExit`` and other ``BaseException`` subclasses too (only ``KeyboardInterrupt``
passes, so Ctrl-C still stops a stuck start-up), exceptions whose ``__str__`` raises, values a
hook returns instead of registering, and output it prints (sent to stderr, so ``--json`` stays
JSON and vLLM's stdout stays clean). Each import and hook call goes through
:func:`quantreg.hookcall.call`, the one caller of plugin code (its watchdog names a plugin stuck
in a device runtime while it is stuck).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy

from . import builtin, hookspecs, settings
from .files import ReadRefused, read_regular
from .hookcall import FIELDS_CHECKED_BY, call, value_problem
from .hookspecs import PROJECT
from .installed import dist_directory, dist_name_version, dist_version
from .problems import describe, printable, quantreg_logger

logger = quantreg_logger("vllm.quantreg")

ENTRY_POINT_GROUP = "quantreg"


@dataclass(frozen=True)
class PluginInfo:
    """A plugin as ``quantreg plugins`` shows it."""

    name: str
    distribution: str
    version: str
    value: str
    status: str  # "loaded", "disabled", "failed", "builtin"
    reason: str = ""


@dataclass(frozen=True)
class PluginFailure:
    """A plugin fault, kept as a value so lenient start-ups can carry on without it."""

    plugin: str
    hook: str
    message: str

    def __str__(self) -> str:
        """One line whatever the plugin put in its name or message (see :func:`printable`)."""
        where = f"plugin '{printable(self.plugin)}'" + (f", hook '{printable(self.hook)}'" if self.hook else "")
        return f"{where}: {printable(self.message)}"


def _names(env: Mapping[str, str], var: str) -> set[str] | None:
    if settings.raw(var, env) is None:
        return None
    return set(settings.value(var, env))


class Plugins:
    """The pluggy manager plus what happened to each discovered plugin."""

    def __init__(self, env: Mapping[str, str] | None = None, entry_points: bool = True) -> None:
        self.env = os.environ if env is None else env
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.infos: list[PluginInfo] = []
        self.failures: list[PluginFailure] = []
        self._add(builtin, builtin.NAME, PluginInfo(builtin.NAME, "quantreg", _own_version(), "quantreg.builtin",
                                                    "builtin"))
        if entry_points:
            self.load_entry_points()

    def load_entry_points(self) -> None:
        allow = _names(self.env, settings.PLUGINS)
        deny = _names(self.env, settings.DISABLE_PLUGINS) or set()
        eps = sorted(group_entry_points(ENTRY_POINT_GROUP), key=lambda e: e.name)
        seen: dict[str, tuple[str, str]] = {}  # entry-point name -> (distribution, value) kept
        for ep in eps:
            dist, version = _dist_of(ep)
            if ep.name in seen:
                first_dist, first_value = seen[ep.name]
                if first_dist != dist:  # two distributions claim one name: only one can be loaded, say so
                    self.failures.append(PluginFailure(
                        ep.name, "", f"entry point name '{ep.name}' is provided by two distributions: "
                        f"'{first_dist}' ({first_value}) is loaded, '{dist}' ({ep.value}) is not; "
                        "uninstall one or rename its entry point"))
                # else the same distribution visible twice on sys.path; the first one wins, like Python imports.
                continue
            seen[ep.name] = (dist, ep.value)
            if allow is not None and ep.name not in allow:
                self.infos.append(PluginInfo(ep.name, dist, version, ep.value, "disabled",
                                             f"not in {settings.PLUGINS}"))
                continue
            if ep.name in deny:
                self.infos.append(PluginInfo(ep.name, dist, version, ep.value, "disabled",
                                             f"listed in {settings.DISABLE_PLUGINS}"))
                continue
            plugin, error = call(f"loading plugin '{printable(ep.name)}' (entry point {printable(ep.value)})",
                                 ep.load, timeout=float(settings.value(settings.PLUGIN_IMPORT_TIMEOUT, self.env)))
            if error is not None:
                self._fail(PluginInfo(ep.name, dist, version, ep.value, "failed"), "",
                           f"entry point {ep.value} failed to import: {error}")
                continue
            self._add(plugin, ep.name, PluginInfo(ep.name, dist, version, ep.value, "loaded"))
        for name in sorted((allow or set()) - set(seen) - {builtin.NAME}):
            self.failures.append(PluginFailure(
                name, "", f"named in {settings.PLUGINS} but no such entry point is installed"))

    def add(self, plugin: ModuleType | object, name: str) -> None:
        """Register a plugin object directly (tests, embedding applications)."""
        self._add(plugin, name, PluginInfo(name, "?", "?", repr(plugin), "loaded"))

    def _add(self, plugin: object, name: str, info: PluginInfo) -> None:
        try:
            self.pm.register(plugin, name=name)
        except (pluggy.PluginValidationError, ValueError) as exc:  # bad hookimpl, or already registered
            self._fail(info, "", _validation_message(exc))
            return
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # pluggy reads every attribute: a module __getattr__ may raise anything
            self._fail(info, "", f"cannot be inspected for hooks: {describe(exc)}")
            return
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:  # a misspelt hook: take back only this registration
            self.pm.unregister(plugin)
            self._fail(info, "", _validation_message(exc))
            return
        self.infos.append(info)

    def _fail(self, info: PluginInfo, hook: str, message: str) -> None:
        failure = PluginFailure(info.name, hook, message)
        self.failures.append(failure)
        self.infos.append(PluginInfo(info.name, info.distribution, info.version, info.value, "failed", message))

    def call_each(self, hook: str, inline_failures: bool = False, **given: Any) -> list[tuple[str, Any]]:
        """Call ``hook`` on every plugin separately, in registration order, isolating faults.

        Each plugin gets its own ``register`` callback (``given`` supplies the hook's other
        arguments; an implementation may take any subset); what it registers is returned as
        ``(plugin name, item)`` pairs. Every call goes through :func:`quantreg.hookcall.call`
        (containment of anything but Ctrl-C, the "still ..." warning naming the plugin), and
        every registered item is checked against the type the hookspec declares for
        ``register`` and its dataclass fields' annotations (:func:`quantreg.hookcall.value_problem`):
        a wrong item is one failure naming the plugin and is dropped alone. All or nothing per
        (plugin, hook) call: a hook that raises contributes nothing from that call; that
        plugin's other hooks are kept. A hook that *returns* something is a fault too, since what
        it meant to register would otherwise vanish silently; its ``register`` calls are kept.
        ``inline_failures``: failures are returned in order among the items as
        ``(plugin, PluginFailure)`` instead of being added to :attr:`failures` (doctor's findings).
        """
        registered: list[tuple[str, Any]] = []
        caller = getattr(self.pm.hook, hook)
        expected = hookspecs.registered_type(hook)
        fields = hook not in FIELDS_CHECKED_BY
        for impl in caller.get_hookimpls():  # registration order: the built-in first, then entry points by name
            staged: list[Any] = []
            name = printable(impl.plugin_name)

            def run(impl: Any = impl, staged: list[Any] = staged) -> Any:
                offered = {**given, "register": staged.append}
                return impl.function(**{arg: offered.get(arg) for arg in impl.argnames})

            returned, error = call(f"calling hook '{hook}' of plugin '{name}'", run)
            out: list[tuple[str, Any]] = []
            if error is not None:
                out.append((impl.plugin_name, PluginFailure(impl.plugin_name, hook, f"raised {error}")))
            else:
                for item in staged:
                    problem = value_problem(item, expected, fields)
                    out.append((impl.plugin_name, item if problem is None else
                                PluginFailure(impl.plugin_name, hook, problem)))
                if returned is not None:
                    out.append((impl.plugin_name, PluginFailure(
                        impl.plugin_name, hook,
                        f"returned a value ({_type_name(returned)}); call register(...) instead")))
            for plugin, item in out:
                if isinstance(item, PluginFailure) and not inline_failures:
                    self.failures.append(item)
                else:
                    registered.append((plugin, item))
        return registered


_ENTRY_POINTS_BYTES = 16 << 20
"""Largest entry_points.txt read (a few KB in practice)."""


def group_entry_points(group: str) -> list[metadata.EntryPoint]:
    """``importlib.metadata.entry_points(group=group)``, without parsing every distribution's file.

    Why: the standard call parses the ``entry_points.txt`` of every installed distribution (167
    in vLLM's venv, torch's and vLLM's console scripts included) into ``EntryPoint`` objects
    before it selects the group: ~3.9 ms of every vLLM process's start-up, right after vLLM's own
    plugin loader did the same scan. This keeps what the standard call does (the same
    distributions in ``sys.path`` order, its uniqueness rule: the first distribution of a
    normalized name wins, by importlib's own key; the same parse of each file that can hold the
    group) and skips parsing a file without the text ``[group]``, which cannot declare it (a
    section header is that text on a line of its own). On an importlib without the key, or a
    distribution that is not a directory on disk, the standard call.
    """
    marker = f"[{group}]"
    seen: set[str] = set()
    found: list[metadata.EntryPoint] = []
    for dist in metadata.distributions():
        key = getattr(dist, "_normalized_name", None)  # what metadata.entry_points() deduplicates by
        if not isinstance(key, str):
            return list(metadata.entry_points(group=group))
        if key in seen:  # shadowed by a distribution of that name earlier on sys.path
            continue
        seen.add(key)
        where = dist_directory(dist)
        if where is None:
            return list(metadata.entry_points(group=group))
        try:  # the one bounded reader: a FIFO planted as entry_points.txt never blocks start-up
            text = read_regular(os.path.join(where, "entry_points.txt"), _ENTRY_POINTS_BYTES)
        except ReadRefused:  # none (most distributions), or not a regular file
            continue
        if marker.encode() in text:
            found.extend(ep for ep in dist.entry_points if ep.group == group)
    return found


def _type_name(value: object) -> str:
    try:
        return type(value).__name__
    except Exception:  # pragma: no cover
        return "object"


def _dist_of(ep: metadata.EntryPoint) -> tuple[str, str]:
    """(distribution name, version) of an entry point; ``?`` where metadata is missing or unreadable."""
    try:
        dist = ep.dist
        if dist is None:
            return "?", "?"
        name, version = dist_name_version(dist)
        # METADATA is outside text: a Name holding a newline forged a line in `quantreg plugins`
        return printable(str(name or "?")), printable(str(version or "?"))
    except Exception:  # broken METADATA must not stop discovery of the other plugins
        return "?", "?"


def _validation_message(exc: Exception) -> str:
    text = str(exc)
    if "unknown hook" in text:
        hooks = ", ".join(sorted(n for n in dir(hookspecs) if hasattr(getattr(hookspecs, n), f"{PROJECT}_spec")))
        return f"{text} (quantreg hooks are: {hooks})"
    return text


def _own_version() -> str:
    return dist_version("quantreg") or "0+unknown"
