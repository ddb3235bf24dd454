"""A table's values: its precedence :class:`Tier`, each :class:`Rule`, the file (:class:`TableFile`) and its
header (:class:`TableHeader`), and a rule's JSON form (:func:`rule_json`).

Split from :mod:`quantreg.table.file` (issue 47): these are what the table pipeline *produces* and every
later stage (index, decisions, registry, tools) reads; ``file.py`` keeps how a YAML file becomes them
(the schema checks) and re-exports them, so ``from quantreg.table.file import Rule`` keeps working.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ..keys import Match
from ..methods import Method
from ..problems import Problem

if TYPE_CHECKING:  # the two optional rule keys' modules are imported when a rule has the key
    from .tuned import TunedEvidence
    from .verify import VerifySpec


class Tier(enum.IntEnum):
    """Where a table comes from, its precedence tier; a higher tier always beats a lower one.

    "Tier", not "layer": a rule's ``layer:`` match key names a kind of vLLM layer (experts, attention,
    dense, lm_head), so the precedence word is another one (issue 47). ``quantreg.Tier`` stays an
    alias of this class for plugins written before the rename."""

    DEFAULT = 0  # the package's registry.yaml
    PLUGIN = 1  # tables contributed by plugins through the register_tables hook
    USER = 2  # QUANTREG_CONFIG
    RUN = 3  # --config on the CLI, additional_config["quantreg"]["config"] in vLLM

    def __str__(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Rule:
    """One row of a table, remembering exactly where it was written."""

    match: Match
    methods: tuple[str, ...]
    path: str
    line: int
    tier: Tier
    priority: int = 0
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    note: str = ""
    method_lines: tuple[int, ...] = ()
    options_line: int | None = None
    where: str = ""  # the rule's position in its file, for messages: rules[3]
    verify: VerifySpec | None = None  # run a second method beside the chosen one (quantreg.table.verify)
    verify_line: int | None = None
    tuned: TunedEvidence | None = None  # the measurements `quantreg tune` ordered the chain by (quantreg.table.tuned)

    @property
    def location(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def tier_label(self) -> str:
        """The rule's precedence tier as every line names it: ``user tier`` (explain, rules, doctor, validate)."""
        return f"{self.tier} tier"

    @property
    def rank(self) -> tuple[int, int, int]:
        """Sort key of the documented precedence: tier, then specificity, then priority."""
        return (int(self.tier), self.match.specificity, self.priority)


def rule_json(rule: Rule) -> dict[str, Any]:
    """A rule as JSON (``quantreg rules``, ``explain --json``, the fingerprint); ``verify`` only when set,
    so tables without it keep their JSON and fingerprint. Beside :class:`Rule`, not in
    :mod:`quantreg.decision`: ``register()`` fingerprints the rules and decides nothing."""
    data: dict[str, Any] = {
        "path": rule.path,
        "line": rule.line,
        "tier": str(rule.tier),  # "layer" before issue 47: it collided with match.layer (a layer kind)
        "match": {
            "quant_format": list(rule.match.quant_format) if rule.match.quant_format else "*",
            "model_type": list(rule.match.model_type) if rule.match.model_type else "*",
            "device": list(rule.match.device) if rule.match.device else "*",
        },
        "method": list(rule.methods),
        "options": dict(rule.options),
        "priority": rule.priority,
        "specificity": rule.match.specificity,
        "note": rule.note,
    }
    if rule.match.layer is not None:  # only when written: tables without it keep their JSON and fingerprint
        data["match"]["layer"] = list(rule.match.layer)
    if rule.match.tokens is not None:  # likewise: the range in its written form
        data["match"]["tokens"] = str(rule.match.tokens)
    for name, values in rule.match.more:  # likewise: a declared match key (keys.MATCH_KEYS) only when written
        data["match"][name] = list(values)
    if rule.verify is not None:
        data["verify"] = rule.verify.to_json()
    if rule.tuned is not None:
        data["tuned"] = dict(rule.tuned.raw)
    return data


@dataclass(frozen=True)
class TableHeader:
    """A file's top-level settings, known whenever its YAML is a mapping, even if rules are rejected.

    The mode (:mod:`quantreg.mode`) reads ``strict`` from here, so a broken table's request for
    strict mode is honoured without parsing the file a second time. A value of the wrong type
    reads as unset (``strict``/``version`` ``None``, ``allow_import_targets`` false); the
    problem itself is reported with the file's other problems.
    """

    path: str
    tier: Tier
    version: int | None = None
    strict: bool | None = None
    allow_import_targets: bool = False
    references: tuple[Rule, ...] = ()
    """Of a table left out for its problems: every rule whose method names could be read (with
    placeholders for its broken keys), so the name and reference checks that need the registered
    methods still run and a file's every problem arrives in one pass (issue 22 class 6)."""
    own_methods: tuple[str, ...] = ()
    deprecations: tuple[Problem, ...] = ()
    """Old spellings this file uses (``verify: {layers: N}``): read like the new ones, each one located line
    (logged once per process through ``vllm.quantreg.table``; ``validate`` and ``explain`` print them)."""


@dataclass(frozen=True)
class TableFile:
    path: str
    tier: Tier
    rules: tuple[Rule, ...]
    strict: bool | None = None
    methods: tuple[Method, ...] = ()
    allow_import_targets: bool = False
    method_lines: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Line of each ``methods:`` entry's name, so a clash between two tables can be located."""
