"""Plugin discovery and hook calls: pluggy, the ``quantreg`` entry-point group, allow/deny lists.

Each entry point is loaded and validated on its own, and each hook implementation is called on
its own, so a plugin that fails to import, misspells a hook or raises becomes a
:class:`PluginFailure` naming the plugin and the hook, and the other plugins keep working.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy

from . import builtin, hookspecs
from .hookspecs import PROJECT

logger = logging.getLogger("vllm.quantreg")

ENTRY_POINT_GROUP = "quantreg"
ALLOW_ENV = "QUANTREG_PLUGINS"
DENY_ENV = "QUANTREG_DISABLE_PLUGINS"


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
        where = f"plugin '{self.plugin}'" + (f", hook '{self.hook}'" if self.hook else "")
        return f"{where}: {self.message}"


def _names(env: Mapping[str, str], var: str) -> set[str] | None:
    raw = env.get(var)
    if raw is None:
        return None
    return {n.strip() for n in raw.split(",") if n.strip()}


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
        allow = _names(self.env, ALLOW_ENV)
        deny = _names(self.env, DENY_ENV) or set()
        eps = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
        seen: set[str] = set()
        for ep in eps:
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            if ep.name in seen:
                # The same distribution visible twice on sys.path; the first one wins, like Python imports.
                continue
            seen.add(ep.name)
            if allow is not None and ep.name not in allow:
                self.infos.append(PluginInfo(ep.name, dist, version, ep.value, "disabled", f"not in {ALLOW_ENV}"))
                continue
            if ep.name in deny:
                self.infos.append(PluginInfo(ep.name, dist, version, ep.value, "disabled", f"listed in {DENY_ENV}"))
                continue
            try:
                plugin = ep.load()
            except Exception as exc:
                self._fail(PluginInfo(ep.name, dist, version, ep.value, "failed"), "",
                           f"entry point {ep.value} failed to import: {type(exc).__name__}: {exc}")
                continue
            self._add(plugin, ep.name, PluginInfo(ep.name, dist, version, ep.value, "loaded"))
        for name in sorted((allow or set()) - seen - {builtin.NAME}):
            self.failures.append(PluginFailure(name, "", f"named in {ALLOW_ENV} but no such entry point is installed"))

    def add(self, plugin: ModuleType | object, name: str) -> None:
        """Register a plugin object directly (tests, embedding applications)."""
        self._add(plugin, name, PluginInfo(name, "?", "?", repr(plugin), "loaded"))

    def _add(self, plugin: object, name: str, info: PluginInfo) -> None:
        try:
            self.pm.register(plugin, name=name)
        except (pluggy.PluginValidationError, ValueError) as exc:  # bad hookimpl, or already registered
            self._fail(info, "", _validation_message(exc))
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

    def call_each(self, hook: str) -> list[tuple[str, Any]]:
        """Call ``hook`` on every plugin separately, in registration order, isolating faults.

        Each plugin gets its own ``register`` callback; what it registers is returned as
        ``(plugin name, item)`` pairs. A hook that raises contributes nothing at all (its earlier
        ``register`` calls are discarded), so a half-run hook never leaves half its methods behind.
        """
        registered: list[tuple[str, Any]] = []
        caller = getattr(self.pm.hook, hook)
        for impl in caller.get_hookimpls():  # registration order: the built-in first, then entry points by name
            staged: list[Any] = []
            try:
                impl.function(**{arg: staged.append for arg in impl.argnames})
            except Exception as exc:
                self.failures.append(PluginFailure(impl.plugin_name, hook, f"raised {type(exc).__name__}: {exc}"))
                continue
            registered += [(impl.plugin_name, item) for item in staged]
        return registered


def _validation_message(exc: Exception) -> str:
    text = str(exc)
    if "unknown hook" in text:
        hooks = ", ".join(sorted(n for n in dir(hookspecs) if hasattr(getattr(hookspecs, n), f"{PROJECT}_spec")))
        return f"{text} (quantreg hooks are: {hooks})"
    return text


def _own_version() -> str:
    try:
        return metadata.version("quantreg")
    except metadata.PackageNotFoundError:
        return "0+unknown"
