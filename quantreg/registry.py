"""The registry: plugins + tables + index, answering keys with cached :class:`Decision` values.

A :class:`Registry` is immutable once built. Rebuilding (new files, new environment) makes a
new one; :func:`get_registry` keeps the process-wide instance the vLLM seam uses. What it is
built from is gathered by :mod:`quantreg.loading`; the mode by :mod:`quantreg.mode`.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .index import Index
from .keys import Key, TokenRange, as_key
from .loading import all_limitations, collect_findings, load
from .methods import VLLM_METHOD, Availability, Method, keeps_vllm
from .mode import Mode, decide_mode
from .plugins import PluginFailure, PluginInfo, Plugins
from .problems import Problem, quantreg_logger
from .table.file import Rule, TableFile, TableHeader, Tier, rule_json

if TYPE_CHECKING:
    from .decision import Decision
    from .findings import Finding
    from .vllm_limits import VllmLimitation

logger = quantreg_logger("vllm.quantreg")

Fault = Problem | PluginFailure
"""Anything that went wrong while loading: a located table problem or a plugin failure."""


class Registry:
    """Everything loaded for one process: methods, effective rules, and what went wrong."""

    def __init__(
        self,
        plugins: Plugins,
        methods: Mapping[str, Method],
        tables: Sequence[TableFile],
        problems: Sequence[Problem],
        headers: Sequence[TableHeader] = (),
    ) -> None:
        self.plugins = plugins
        self.methods = dict(methods)
        self.tables = tuple(tables)
        self.problems = tuple(problems)
        self.headers = tuple(headers)  # of every file read whose YAML was a mapping, kept or not
        self.index = Index(r for t in self.tables for r in t.rules)
        self._decisions: dict[Key, Decision] = {}
        self._availability: dict[tuple[str, str], Availability] = {}
        self._findings: dict[str | None, tuple[Finding, ...]] = {}
        self._limitations: tuple[list[VllmLimitation], list[str]] | None = None
        self._vllm_availability: dict[Key, Availability] = {}
        self._lock = threading.Lock()

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
        """Load plugins and tables. ``config`` files form the ``run`` tier (CLI ``--config``)."""
        env = os.environ if env is None else env
        pl = Plugins(env, entry_points=entry_points)
        for name, plugin in plugins:
            pl.add(plugin, name)
        loaded = load(pl, env, config, default_table)
        return cls(pl, loaded.methods, loaded.tables, loaded.problems, loaded.headers)

    # -- what went wrong, and how much it matters -------------------------------------------
    @property
    def failures(self) -> tuple[PluginFailure, ...]:
        return tuple(self.plugins.failures)

    @property
    def faults(self) -> tuple[Fault, ...]:
        """Every table problem, then every plugin failure: what the CLI prints and the seam reports."""
        return (*self.problems, *self.plugins.failures)

    @property
    def plugin_infos(self) -> tuple[PluginInfo, ...]:
        return tuple(self.plugins.infos)

    def mode(self, run_strict: bool | None = None, shipped_strict: bool = False) -> Mode:
        """Strict or lenient for this registry, plus the run's ``additional_config`` strict and the
        shipping driver's strictness (both known only inside vLLM: :func:`quantreg.vllm.startup.mode_of`)."""
        return decide_mode(self.plugins.env, self.headers, run_strict, shipped_strict)

    @property
    def strict(self) -> bool:
        """``self.mode().strict``: the environment or a user/run table header asks for strict."""
        return self.mode().strict

    # -- answering --------------------------------------------------------------------------
    def availability(self, method: str, device: str) -> Availability:
        """Cached per (method, device): probes may be slow and their answer does not change."""
        cache_key = (method, device)
        found = self._availability.get(cache_key)
        if found is None:
            m = self.methods.get(method)
            found = Availability(False, "not registered by any plugin") if m is None else m.availability(device)
            self._availability[cache_key] = found
        return found

    def availability_for(self, method: str, key: Key) -> Availability:
        """Can ``method`` run for ``key`` on this host? ``vllm`` too: unless a limitation holds.

        Why per key for ``vllm`` only: vLLM's own method has a kernel for some keys and not
        others on a given host (GPT-OSS MXFP4 on a CPU without AMX); a registered method's
        answer depends on the device alone. Cached like :meth:`availability`: a limitation's
        check reads host facts (no torch, no vLLM), so the answer is cheap and fixed per process.
        """
        if not keeps_vllm(method):
            m = self.methods.get(method)
            if m is not None and key.layer not in m.layers:  # a MoE method for an lm_head key, or back
                return Availability(False, f"decides {', '.join(m.layers)} layers, not {key.layer}")
            return self.availability(method, key.device)
        found = self._vllm_availability.get(key)
        if found is None:
            held = [lim for lim in self.limitations()[0] if lim.matches(key) and lim.holds()]
            if held:
                reasons = "; ".join(lim.reason + (f" (from plugin '{lim.plugin}')" if lim.plugin else "")
                                    for lim in held)
                found = Availability(False, f"vLLM's own method cannot run here: {reasons}. "
                                     f"{self.serving_advice(key)}")
            else:
                found = Availability(True, "vLLM's own method")
            self._vllm_availability[key] = found
        return found

    def collisions(self) -> list[str]:
        """One line per pair where a rule takes keys that another plugin's packaged rule would decide.

        Why: a plugin's rules ship with the plugin; when a second plugin (or the user's table) has a
        rule for an overlapping key, one of them silently decides. Said once per pair, naming both
        rules and which wins (precedence: tier, then specificity, then priority). Pairs inside one
        file are the table's own business (``validate`` reports ambiguous ones).
        """
        from .decision import why_lost

        lines: list[str] = []
        packaged = [r for t in self.tables if t.tier == Tier.PLUGIN for r in t.rules]
        others = [r for t in self.tables if t.tier >= Tier.PLUGIN for r in t.rules]
        seen: set[tuple[str, str]] = set()
        for b in packaged:
            for a in others:
                if a is b or a.path == b.path or not a.match.overlaps(b.match):
                    continue
                pair = tuple(sorted((a.location, b.location)))
                if pair in seen:
                    continue
                seen.add(pair)  # type: ignore[arg-type]
                if a.rank == b.rank:
                    continue  # an exact tie: reported as ambiguous by the table checks
                win, lose = (a, b) if a.rank > b.rank else (b, a)
                lines.append(f"rule {win.location} [{win.tier_label}] ({', '.join(win.methods)}) takes keys matching "
                             f"{win.match} from rule {lose.location} [{lose.tier_label}] ({', '.join(lose.methods)}), "
                             f"which loses: {why_lost(lose, win)}")
        return lines

    def serving_alternatives(self, key: Key) -> list[tuple[str, str]]:
        """Installed methods that can serve ``key`` on this host, best first, each with the rule that names it.

        The registry's own answer, not a literal: the non-``vllm`` methods of the rules that match
        the key, in precedence order (a plugin's packaged rule for the key names its method there),
        then methods of plugins whose rules name the key's quant format on another device, when
        they run on this one (e.g. a CPU reference method that a Gaudi plugin registers).
        Only methods available here count.
        """
        found: list[tuple[str, str]] = []
        seen: set[str] = set()

        def consider(name: str, where: str) -> None:
            if name in seen or keeps_vllm(name):
                return
            seen.add(name)
            if self.availability(name, key.device).ok:
                found.append((name, where))

        for rule in self.index.candidates(key):
            for name in rule.methods:
                consider(name, f"rule {rule.location}")
        plugins: set[str] = set()  # plugins whose packaged rules name the key's quant format
        for table in self.tables:
            for rule in table.rules:
                formats = rule.match.quant_format
                if table.tier == Tier.PLUGIN and formats is not None and key.quant_format in formats:
                    plugins.update(self.methods[n].plugin for n in rule.methods if n in self.methods)
        for name, m in sorted(self.methods.items()):
            if m.plugin and m.plugin in plugins and m.runs_on(key.device):
                consider(name, f"plugin '{m.plugin}'")
        return found

    def serving_advice(self, key: Key) -> str:
        """One sentence: which installed method would serve ``key`` here (or how to get one)."""
        alternatives = self.serving_alternatives(key)
        if not alternatives:
            return ("No installed quantreg method serves it here: install a plugin whose method does "
                    "(quantreg list shows the registered ones) or serve a bf16 checkpoint")
        name, where = alternatives[0]
        others = ", ".join(n for n, _ in alternatives[1:])
        return f"Installed here: '{name}' serves it ({where})" + (f"; also {others}" if others else "")

    def resolve(self, key: Key | tuple[str, str, str]) -> Decision:
        key = as_key(key)
        with self._lock:
            found = self._decisions.get(key)
            if found is None:
                found = self._decide(key)
                self._decisions[key] = found
        return found

    def _decide(self, key: Key) -> Decision:
        # on the first decision, not at import: register() decides nothing
        from .decision import Decision

        matched = self.index.candidates(key)
        if not matched:
            return Decision(key, VLLM_METHOD, None, {}, (), (), None)
        if all(r.match.tokens is None for r in matched):
            return self._decide_rule(key, matched, ())
        sides = token_sides(matched)
        if len(sides) == 1:  # the ranged rules lose everywhere (or one rule covers every count)
            _, covering, rest = sides[0]
            return self._decide_rule(key, covering, rest)
        from dataclasses import replace

        from .decision import TokenSide

        split = tuple(TokenSide(rng, self._decide_rule(key, covering, rest, rng)) for rng, covering, rest in sides)
        return replace(split[0].decision, split=split)

    def _decide_rule(self, key: Key, matched: Sequence[Rule], elsewhere: Sequence[Rule],
                     tokens: TokenRange | None = None) -> Decision:
        """The decision among ``matched`` (best first; may be empty: no rule covers these token counts).

        ``elsewhere`` are the key's rules whose token range does not cover ``tokens``: listed as
        candidates that lost for that reason, so ``explain`` names every rule of the key.
        """
        from .decision import NOT_TRIED, OUT_OF_RANGE, Candidate, ChainStep, Decision, why_lost, why_won
        from .host import host_facts

        outside = tuple(Candidate(r, False, f"{OUT_OF_RANGE}{r.match.tokens} does not cover tokens{tokens}")
                        for r in elsewhere)
        if not matched:
            return Decision(key, VLLM_METHOD, None, {}, outside, (), None)
        winner = matched[0]
        candidates = [Candidate(winner, True, why_won(winner, matched[1:]))]
        candidates += [Candidate(r, False, why_lost(r, winner)) for r in matched[1:]]
        chain: list[ChainStep] = []
        chosen: str | None = None
        for name in winner.methods:
            if chosen is not None:
                chain.append(ChainStep(name, False, f"{NOT_TRIED}: '{chosen}' came first", self._plugin_of(name)))
                continue
            avail = self.availability_for(name, key)
            chain.append(ChainStep(name, avail.ok, avail.reason, self._plugin_of(name)))
            if avail.ok:
                chosen = name
        fallback = None
        if chosen is None:
            fallback = "no method in the chain is available here; vLLM keeps its own method"
            vllm_here = self.availability_for(VLLM_METHOD, key)
            if not vllm_here.ok and VLLM_METHOD not in winner.methods:  # else the chain says it, once
                fallback += f"; and {vllm_here.reason}"
            chosen = VLLM_METHOD
        options = winner.options if fallback is None else {}
        return Decision(key, chosen, winner, options, (*candidates, *outside), tuple(chain), fallback,
                        host=host_facts().as_json(), stale=tuple(s.text() for s in self.stale_evidence(winner)))

    def next_choices(self, decision: Decision) -> list[Decision]:
        """What serves ``decision``'s key when its method cannot be built (the seams' walk, ``explain``'s note):
        each method known to run here (:meth:`availability_for`) in the rest of the winning rule's chain,
        then in each losing rule's chain, in precedence order, with its own rule's options; an
        available ``vllm`` among them ends the walk where it stands."""
        from dataclasses import replace

        from .decision import OUT_OF_RANGE

        if decision.rule is None:
            return []
        names = list(decision.rule.methods)
        rest = names[names.index(decision.method) + 1:] if decision.method in names else []
        rules = [(decision.rule, rest)] + [(c.rule, list(c.rule.methods)) for c in decision.candidates
                                           if not c.won and not c.reason.startswith(OUT_OF_RANGE)]
        return [replace(decision, method=name, rule=rule, options={} if keeps_vllm(name) else rule.options,
                        fallback=None, stale=(), split=())
                for rule, methods in rules for name in methods if self.availability_for(name, decision.key).ok]

    def stale_evidence(self, rule: Rule, shape: Mapping[str, Any] | None = None) -> list[Any]:
        """The :class:`quantreg.pins.Stale` fields of ``rule``'s ``tuned.pins`` here (none without pins)."""
        pins = rule.tuned.raw.get("pins") if rule.tuned is not None else None
        if pins is None or (isinstance(pins, Mapping) and not pins):
            return []
        from .pins import stale_pins  # only tables written by tune pay for the check

        return stale_pins(pins, self, shape)

    def findings(self, device: str | None) -> tuple[Finding, ...]:
        """The plugins' ``doctor_findings`` for ``device``, asked once per registry and device.

        Plugins get :meth:`resolve` (a value), never the registry (see :mod:`quantreg.findings`).
        Imported here, not at module level: a vLLM start-up that decides nothing pays nothing.
        """
        found = self._findings.get(device)
        if found is None:
            found = tuple(collect_findings(self.plugins, self.resolve, device))
            self._findings[device] = found
        return found

    def limitations(self) -> tuple[list[VllmLimitation], list[str]]:
        """vLLM's known limitations (built in and the plugins'), and bad registrations; asked once."""
        if self._limitations is None:
            self._limitations = all_limitations(self.plugins)
        return self._limitations

    def _plugin_of(self, name: str) -> str:
        m = self.methods.get(name)
        return m.plugin if m is not None else ""

    def fingerprint(self) -> str:
        """Hash of the effective rules and the plugins that made them, to compare processes and nodes.

        Content, not install paths: each table is named by :mod:`quantreg.table.identity`
        (``DIST:relative/path`` for a packaged table, ``TIER#N`` for the others), so two installs
        at different paths, or one table kept at two paths, give one fingerprint.
        """
        from .table.identity import table_names

        names = table_names([(t.path, str(t.tier)) for t in self.tables])

        def named(rule: Rule) -> dict[str, Any]:
            data = rule_json(rule)
            data["path"] = names.get(rule.path, rule.path)
            # hashed under the pre-issue-47 keys (a rule's "tier" was "layer", verify's "decoders" was
            # "layers"), so an unchanged table keeps its fingerprint across the rename
            data["layer"] = data.pop("tier")
            if "verify" in data:
                data["verify"]["layers"] = data["verify"].pop("decoders")
            return data

        def plugin(name: str) -> str:  # a table's ``methods:`` entries belong to "table PATH"
            return f"table {names.get(name[6:], name[6:])}" if name.startswith("table ") else name

        payload: dict[str, Any] = {
            "rules": [named(r) for r in self.index.rules],
            "methods": sorted((m.name, m.target, plugin(m.plugin)) for m in self.methods.values()),
            "plugins": sorted((p.name, p.distribution, p.version, p.status) for p in self.plugins.infos),
        }
        # A hook call that failed here dropped what it would have registered (keepers, limitations,
        # findings leave no rule behind): a process where a hook failed alone must not look like
        # the others. Which hook of which plugin, not the message (it may name this process).
        failed = sorted({(f.plugin, f.hook) for f in self.plugins.failures})
        if failed:  # absent when nothing failed: fingerprints of healthy registries are unchanged
            payload["failed_hooks"] = failed
        # a tuned rule whose evidence does not match this process: the same table decides the same,
        # yet on evidence measured elsewhere; which fields, so such a process does not look like the others
        stale = sorted({s.field for r in self.index.rules for s in self.stale_evidence(r)})
        if stale:
            payload["stale_tuned"] = stale
        blob = json.dumps(payload, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# -- the process-wide registry ------------------------------------------------------------------
# One per process, built on first use from the environment; the vLLM seam and ``register()`` use
# it, and ``set_registry`` swaps it when a run brings its own tables (additional_config).
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


def token_sides(matched: Sequence[Rule]) -> list[tuple[TokenRange, list[Rule], list[Rule]]]:
    """The token counts 1..inf cut where ``matched``'s ``tokens:`` ranges start or end, each piece
    decided by the usual precedence among the rules that cover it; neighbours with one winner merged.

    Returns (range, covering rules best first, the key's other rules) per side, lowest counts first.
    A count no ranged rule covers falls to the best rule without a range (or to no rule: vLLM keeps
    its own method for those forwards), the stated rule for gaps (docs/tables.md, "Token ranges").
    """
    cuts = {1}
    for rule in matched:
        tokens = rule.match.tokens
        if tokens is not None:
            cuts.add(tokens.low)
            if tokens.high is not None:
                cuts.add(tokens.high + 1)
    points = sorted(cuts)
    pieces = [TokenRange(lo, (points[i + 1] - 1) if i + 1 < len(points) else None) for i, lo in enumerate(points)]
    sides: list[tuple[TokenRange, list[Rule], list[Rule]]] = []
    for piece in pieces:
        covering = [r for r in matched if r.match.tokens is None or r.match.tokens.contains(piece)]
        rest = [r for r in matched if r.match.tokens is not None and not r.match.tokens.contains(piece)]
        winner = covering[0] if covering else None
        if sides and (sides[-1][1][0] if sides[-1][1] else None) is winner:
            prev = sides[-1][0]
            sides[-1] = (TokenRange(prev.low, piece.high), sides[-1][1], sides[-1][2])
            continue
        sides.append((piece, covering, rest))
    # a merged side: the rules covering all of it (its winner first, as in each piece) and the others
    return [(rng, [r for r in matched if r.match.tokens is None or r.match.tokens.contains(rng)],
             [r for r in matched if r.match.tokens is not None and not r.match.tokens.contains(rng)])
            for rng, _, _ in sides]
