"""The registry: plugins + tables + index, answering keys with cached :class:`Decision` values.

A :class:`Registry` is immutable once built. Rebuilding (new files, new environment) makes a
new one; :func:`get_registry` keeps the process-wide instance the vLLM seam uses.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .builtin import default_table_path
from .decision import Candidate, ChainStep, Decision, rule_json
from .index import Index, ambiguity_problems
from .keys import Key
from .methods import VLLM_METHOD, Availability, Method, check_specifier
from .plugins import PluginFailure, PluginInfo, Plugins
from .problems import Problem, did_you_mean, name_list
from .tables import NAME_RE, Layer, Rule, TableFile, read_table

logger = logging.getLogger("vllm.quantreg")

CONFIG_ENV = "QUANTREG_CONFIG"
STRICT_ENV = "QUANTREG_STRICT"


def config_paths(env: Mapping[str, str]) -> tuple[str, ...]:
    """User table paths from ``QUANTREG_CONFIG`` (``os.pathsep``-separated, empty parts ignored)."""
    return tuple(p for p in env.get(CONFIG_ENV, "").split(os.pathsep) if p.strip())


def check_method(method: Any) -> str | None:
    """What is wrong with something a plugin passed to ``register()``, or ``None``."""
    if not isinstance(method, Method):
        return f"register() expects a quantreg.Method, got {type(method).__name__}"
    if not re.fullmatch(NAME_RE, method.name):
        return f"method name {method.name!r} is not valid (letters, digits, '_', '.', '-')"
    module, sep, attr = method.target.partition(":")
    if not (sep and module and attr):
        return f"method '{method.name}': target {method.target!r} is not of the form 'package.module:Class'"
    if method.vllm_version:
        bad = check_specifier(method.vllm_version)
        if bad:
            return f"method '{method.name}': vllm_version {bad}"
    return None


def collect_methods(registered: Iterable[tuple[str, Any]], failures: list[PluginFailure]) -> dict[str, Method]:
    """Plugin registrations → methods by name; the first registration of a name wins."""
    methods: dict[str, Method] = {}
    for plugin, method in registered:
        problem = check_method(method)
        if problem is None and method.name in methods:
            problem = (f"method '{method.name}' is already registered by plugin "
                       f"'{methods[method.name].plugin}'; the first one is kept")
        if problem:
            failures.append(PluginFailure(plugin, "register_methods", problem))
            continue
        methods[method.name] = Method(**{**method.__dict__, "plugin": plugin})
    return methods


class Registry:
    """Everything loaded for one process: methods, effective rules, and what went wrong."""

    def __init__(
        self,
        plugins: Plugins,
        methods: Mapping[str, Method],
        tables: Sequence[TableFile],
        problems: Sequence[Problem],
    ) -> None:
        self.plugins = plugins
        self.methods = dict(methods)
        self.tables = tuple(tables)
        self.problems = tuple(problems)
        self.index = Index(r for t in self.tables for r in t.rules)
        self._decisions: dict[Key, Decision] = {}
        self._availability: dict[tuple[str, str], Availability] = {}
        self._lock = threading.Lock()
        self.declared_strict = False

    # -- building ---------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        config: Sequence[str | os.PathLike[str]] = (),
        env: Mapping[str, str] | None = None,
        entry_points: bool = True,
        plugins: Iterable[tuple[str, object]] = (),
        default_table: str | os.PathLike[str] | None = None,
    ) -> Registry:
        """Load plugins and tables. ``config`` files form the ``run`` layer (CLI ``--config``)."""
        env = os.environ if env is None else env
        pl = Plugins(env, entry_points=entry_points)
        for name, plugin in plugins:
            pl.add(plugin, name)
        methods = collect_methods(pl.call_each("register_methods"), pl.failures)
        paths: list[tuple[str, Layer]] = [(str(default_table or default_table_path()), Layer.DEFAULT)]
        for plugin, path in pl.call_each("register_tables"):
            if isinstance(path, (str, os.PathLike)):
                paths.append((os.fspath(path), Layer.PLUGIN))
            else:
                pl.failures.append(PluginFailure(plugin, "register_tables",
                                                 f"register() expects a path, got {type(path).__name__}"))
        paths += [(p, Layer.USER) for p in config_paths(env)]
        paths += [(os.fspath(p), Layer.RUN) for p in config]
        tables, problems = load_tables(paths, methods)
        for table in tables:
            methods.update({m.name: m for m in table.methods})
        registry = cls(pl, methods, tables, problems)
        registry.declared_strict = any(declares_strict(path) for path, layer in paths
                                       if layer >= Layer.USER and any(p.path == path for p in problems))
        return registry

    # -- answering --------------------------------------------------------------------------
    @property
    def failures(self) -> tuple[PluginFailure, ...]:
        return tuple(self.plugins.failures)

    @property
    def plugin_infos(self) -> tuple[PluginInfo, ...]:
        return tuple(self.plugins.infos)

    @property
    def strict(self) -> bool:
        """Strict when ``QUANTREG_STRICT=1`` or a user/run table says ``strict: true``.

        A user table that asks for strict mode but is itself broken still counts: dropping it
        must not quietly downgrade the server to lenient. Plugin tables cannot set the mode.
        """
        if self.plugins.env.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
            return True
        return self.declared_strict or any(t.strict for t in self.tables if t.layer >= Layer.USER)

    def availability(self, method: str, device: str) -> Availability:
        """Cached per (method, device): probes may be slow and their answer does not change."""
        cache_key = (method, device)
        found = self._availability.get(cache_key)
        if found is None:
            m = self.methods.get(method)
            found = Availability(False, "not registered by any plugin") if m is None else m.availability(device)
            self._availability[cache_key] = found
        return found

    def resolve(self, key: Key | tuple[str, str, str]) -> Decision:
        key = Key(*key)
        with self._lock:
            found = self._decisions.get(key)
            if found is None:
                found = self._decide(key)
                self._decisions[key] = found
        return found

    def _decide(self, key: Key) -> Decision:
        matched = self.index.candidates(key)
        if not matched:
            return Decision(key, VLLM_METHOD, None, {}, (), (), None)
        winner = matched[0]
        candidates = [Candidate(winner, True, _why_won(winner, matched[1:]))]
        candidates += [Candidate(r, False, _why_lost(r, winner)) for r in matched[1:]]
        chain: list[ChainStep] = []
        chosen: str | None = None
        for name in winner.methods:
            if chosen is not None:
                chain.append(ChainStep(name, False, f"not tried: '{chosen}' came first", self._plugin_of(name)))
                continue
            avail = self.availability(name, key.device)
            chain.append(ChainStep(name, avail.ok, avail.reason, self._plugin_of(name)))
            if avail.ok:
                chosen = name
        fallback = None
        if chosen is None:
            fallback = "no method in the chain is available here; vLLM keeps its own method"
            chosen = VLLM_METHOD
        options = winner.options if fallback is None else {}
        return Decision(key, chosen, winner, options, tuple(candidates), tuple(chain), fallback)

    def _plugin_of(self, name: str) -> str:
        m = self.methods.get(name)
        return m.plugin if m is not None else ""

    def fingerprint(self) -> str:
        """Hash of the effective rules and the plugins that made them, to compare processes."""
        payload = {
            "rules": [rule_json(r) for r in self.index.rules],
            "methods": sorted((m.name, m.target, m.plugin) for m in self.methods.values()),
            "plugins": sorted((p.name, p.distribution, p.version, p.status) for p in self.plugins.infos),
        }
        blob = json.dumps(payload, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def load_tables(
    paths: Sequence[tuple[str, Layer]], methods: Mapping[str, Method]
) -> tuple[list[TableFile], list[Problem]]:
    """Read every table, check method names and options, then drop whole files involved in ties.

    Methods defined in user tables count only while their table is valid, so dropping one
    table can invalidate another that used its methods: repeat until nothing changes.
    """
    parsed: list[TableFile] = []
    problems: list[Problem] = []
    seen: set[tuple[str, Layer]] = set()
    for path, layer in paths:
        ident = (os.path.realpath(path), layer)
        if ident in seen:  # the same file listed twice in one layer is one table, not a tie with itself
            continue
        seen.add(ident)
        table, found = read_table(path, layer)
        problems += found
        if table is not None:
            parsed.append(table)
    tables = parsed
    while True:
        known = dict(methods)
        for table in tables:
            for m in table.methods:
                if m.name in known:
                    problems.append(Problem(table.path, None, f"methods.{m.name}",
                                            f"method '{m.name}' is already registered by '{known[m.name].plugin}'"))
                else:
                    known[m.name] = m
        bad = {t.path for t in tables if any(p.path == t.path for p in problems)}
        for table in tables:
            found = method_problems(table, known)
            problems += found
            if found:
                bad.add(table.path)
        if not bad:
            break
        tables = [t for t in tables if t.path not in bad]
    # Reports are capped per pass (MAX_AMBIGUITIES), so look again until the kept files are free of ties.
    while pairs := Index(r for t in tables for r in t.rules).ambiguous_pairs():
        problems += ambiguity_problems(pairs)
        bad = {r.path for pair in pairs for r in pair}
        tables = [t for t in tables if t.path not in bad]
    return tables, problems


def declares_strict(path: str) -> bool:
    """Does this (possibly broken) table ask for strict mode at its top level?"""
    try:
        from .yamlfile import parse

        with open(path, encoding="utf-8") as f:
            doc = parse(f.read())
    except Exception:  # unreadable or not YAML: it cannot be said to ask for anything
        return False
    return isinstance(doc, dict) and doc.get("strict") is True


def method_problems(table: TableFile, methods: Mapping[str, Method]) -> list[Problem]:
    """Methods a rule names must be registered, and its options accepted by each of them.

    Options go to whichever method of the chain is chosen, so every method that declares its
    options must accept all of them (``vllm`` takes none and ignores them).
    """
    problems = []
    for i, rule in enumerate(table.rules):
        for j, name in enumerate(rule.methods):
            line = rule.method_lines[j] if j < len(rule.method_lines) else rule.line
            method = methods.get(name)
            if method is None:
                problems.append(Problem(
                    table.path, line, f"rules[{i}].method",
                    f"unknown method '{name}'{did_you_mean(name, sorted(methods))} "
                    f"(registered: {name_list(sorted(methods))})"))
                continue
            if method.options is None or name == VLLM_METHOD:
                continue
            for option in rule.options:
                if option not in method.options:
                    accepted = ", ".join(method.options) or "none"
                    problems.append(Problem(
                        table.path, rule.options_line or rule.line, f"rules[{i}].options.{option}",
                        f"method '{name}' does not accept option '{option}'"
                        f"{did_you_mean(option, method.options)} (accepted: {accepted})"))
    return problems


def _why_won(winner: Rule, others: Sequence[Rule]) -> str:
    if not others:
        return "the only matching rule"
    return "highest precedence (layer, then specificity, then priority)"


def _why_lost(rule: Rule, winner: Rule) -> str:
    if rule.layer != winner.layer:
        return f"lower layer ({rule.layer} < {winner.layer})"
    if rule.match.specificity != winner.match.specificity:
        return f"less specific ({rule.match.specificity} < {winner.match.specificity} named fields)"
    return f"lower priority ({rule.priority} < {winner.priority})"


_current: Registry | None = None
_current_lock = threading.Lock()


def get_registry(config: Sequence[str | os.PathLike[str]] = ()) -> Registry:
    """The process-wide registry, built on first use from the environment."""
    global _current
    with _current_lock:
        if _current is None:
            _current = Registry.build(config)
        return _current


def set_registry(registry: Registry | None) -> None:
    """Replace (or with ``None`` forget) the process-wide registry, e.g. after new config."""
    global _current
    with _current_lock:
        _current = registry


def resolve(key: Key | tuple[str, str, str]) -> Decision:
    """Resolve ``key`` with the process-wide registry."""
    return get_registry().resolve(key)

