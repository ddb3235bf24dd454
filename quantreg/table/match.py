"""A rule's ``match:`` mapping -> :class:`quantreg.keys.Match`, every fault a located problem.

The match keys: quant_format / model_type / device (a value, a list or ``*``), ``layer`` (layer
kinds, never a wildcard), ``tokens`` (a forward's token-count range) and every key declared in
:data:`quantreg.keys.MATCH_KEYS` (read from the declaration, so a new key adds no code here).
Split from :mod:`quantreg.table.file` (issue 47), which checks the rest of a file and inherits these
checks.
"""

from __future__ import annotations

import re
from typing import Any

from .. import keys
from ..keys import EXPERTS, FIELDS, LAYER, LAYER_KINDS, TOKENS, WILDCARD, Match, TokenRange
from ..methods import valid_name
from ..problems import Problem, did_you_mean, type_name

MATCH_VALUE_RE = r"^[\w.\-]+$"
"""Match values (quant_format, model_type, device): ``\\w`` is Unicode here (letters and digits of
any script, ``_``), because vLLM takes ``model_type`` verbatim from a checkpoint's config.json."""
_MATCH_VALUE = re.compile(MATCH_VALUE_RE).fullmatch


class MatchChecker:
    """The checks of a ``match:`` mapping (and of names), collecting located problems for ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.problems: list[Problem] = []

    def fail(self, line: int | None, key: str, message: str) -> None:
        self.problems.append(Problem(self.path, line, key, message))

    def unknown_keys(self, mapping: dict[Any, Any], allowed: tuple[str, ...], where: str) -> None:
        key_lines = getattr(mapping, "key_lines", {})
        for k in mapping:
            if k not in allowed:
                name = f"{where}.{k}" if where else str(k)
                hint = did_you_mean(str(k), allowed)
                self.fail(key_lines.get(k), name, f"unknown key{hint} (expected one of: {', '.join(allowed)})")

    def match(self, raw: Any, where: str, line: int, present: bool) -> Match | None:
        if not present:
            self.fail(line, where, "missing; expected a mapping of quant_format / model_type / device ({} matches all)")
            return None
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            self.fail(line, where, f"expected a mapping of {', '.join(FIELDS)}, got {type_name(raw)}")
            return None
        key_lines: dict[Any, int] = getattr(raw, "key_lines", {})
        self.unknown_keys(raw, (*FIELDS, LAYER, TOKENS, *(k.name for k in keys.MATCH_KEYS)), where)
        values: dict[str, tuple[str, ...] | None] = {}
        ok = True
        if LAYER in raw:
            layers = self.layer_kinds(raw[LAYER], key_lines.get(LAYER, line), f"{where}.{LAYER}")
            ok &= layers is not None
            values[LAYER] = layers
        tokens: TokenRange | None = None
        if TOKENS in raw:
            tokens = self.token_range(raw[TOKENS], key_lines.get(TOKENS, line), f"{where}.{TOKENS}",
                                      values.get(LAYER))
            ok &= tokens is not None
        for name in FIELDS:
            v = raw.get(name, WILDCARD)
            vline = key_lines.get(name, line)
            sub = f"{where}.{name}"
            if v == WILDCARD:
                values[name] = None
            elif isinstance(v, str):
                ok &= self.name(v, vline, sub, match_value=True)
                values[name] = (v,)
            elif isinstance(v, list):
                if not v:
                    self.fail(vline, sub, "empty list; use '*' to match anything")
                    ok = False
                    continue
                for x in v:
                    if not isinstance(x, str):
                        self.fail(vline, sub, f"list items must be strings, got {type_name(x)}")
                        ok = False
                    elif x == WILDCARD:
                        self.fail(vline, sub, "'*' cannot be inside a list; write it alone")
                        ok = False
                    else:
                        ok &= self.name(x, vline, sub, match_value=True)
                values[name] = tuple(sorted({x for x in v if isinstance(x, str)}))
            else:
                self.fail(vline, sub, f"expected a string, '*' or a list of strings, got {type_name(v)}")
                ok = False
        more = []
        for declared in keys.MATCH_KEYS:
            if declared.name in raw:
                found = self.declared_values(declared, raw[declared.name], key_lines.get(declared.name, line),
                                             f"{where}.{declared.name}")
                ok &= found is not None
                more.append((declared.name, found or ()))
        if not ok:
            return None
        return Match(values.get("quant_format"), values.get("model_type"), values.get("device"), values.get(LAYER),
                     tokens=tokens, more=tuple(sorted(more)))

    def listed(self, v: Any, line: int, where: str, expected: str) -> list[Any] | None:
        """A match value that may be one item or a non-empty list, as a list (``None`` after the located
        fault for an empty list: it would match nothing, which no one writes on purpose)."""
        if isinstance(v, list) and not v:
            self.fail(line, where, f"empty list; {expected}")
            return None
        return v if isinstance(v, list) else [v]

    def declared_values(self, declared: keys.MatchKey, v: Any, line: int, where: str) -> tuple[str, ...] | None:
        """A :data:`quantreg.keys.MATCH_KEYS` key: one value or a non-empty list, each one of ``declared.values``
        (or any match value when it has none); no wildcard (leave the key out to match every value)."""
        expected = (f"one of {', '.join(declared.values)}" if declared.values is not None else "a name")
        items = self.listed(v, line, where, f"expected {expected} or a list of them")
        if items is None:
            return None
        ok = True
        for x in items:
            if x == WILDCARD:
                self.fail(line, where, f"'*' is not a value; leave '{declared.name}' out to match every value")
                ok = False
            elif not isinstance(x, str):
                self.fail(line, where, f"expected {expected} or a list of them, got {type_name(x)}")
                ok = False
            elif declared.values is not None and x not in declared.values:
                self.fail(line, where, f"expected {expected}, got {x!r}{did_you_mean(x, declared.values)}")
                ok = False
            elif declared.values is None:
                ok &= self.name(x, line, where, match_value=True)
        return tuple(sorted(set(items))) if ok else None

    def token_range(self, v: Any, line: int, where: str, layers: tuple[str, ...] | None) -> TokenRange | None:
        """``tokens``: a forward's token count bound, ``"<=N"`` / ``"<N"`` / ``">N"`` / ``">=N"`` (a YAML string)."""
        if not isinstance(v, str):
            shown = f"{v!r} ({type_name(v)})" if isinstance(v, (int, float)) else type_name(v)
            self.fail(line, where, f"expected a quoted string \"<=N\", \">N\", \">=N\" or \"<N\" "
                                   f"(N a positive integer), got {shown}")
            return None
        try:
            found = TokenRange.parse(v)
        except ValueError as exc:
            shown = repr(v) if len(v) <= 40 else repr(v[:37]) + "..."
            self.fail(line, where, f"{shown}: {exc}")
            return None
        if layers is not None and layers != (EXPERTS,):
            self.fail(line, where, "a token range decides per forward, which only the experts' seam does; "
                                   "write it on rules of layer experts (dense layers are decided once per layer)")
            return None
        return found

    def layer_kinds(self, v: Any, line: int, where: str) -> tuple[str, ...] | None:
        """``layer``: one kind or a list of kinds (no wildcard: a rule deciding other layers names them)."""
        expected = f"expected one of {', '.join(LAYER_KINDS)} or a list of them"
        items = self.listed(v, line, where, expected)
        if items is None:
            return None
        ok = True
        for x in items:
            if x == WILDCARD:
                self.fail(line, where, f"'*' is not a layer kind (a rule without 'layer' decides the experts); "
                                       f"list the kinds: [{', '.join(LAYER_KINDS)}]")
                ok = False
            elif not isinstance(x, str) or x not in LAYER_KINDS:
                shown = repr(x) if isinstance(x, str) else type_name(x)
                hint = did_you_mean(x, LAYER_KINDS) if isinstance(x, str) else ""
                self.fail(line, where, f"unknown layer kind {shown}{hint}; {expected}")
                ok = False
        if not ok:
            return None
        return tuple(k for k in LAYER_KINDS if k in items)  # one order, so equal matches compare equal

    def name(self, v: str, line: int, where: str, *, match_value: bool = False) -> bool:
        """A method name (ASCII) or, with ``match_value``, a match value (any script's letters, see docs/tables.md)."""
        if not (_MATCH_VALUE(v) if match_value else valid_name(v)):
            shown = repr(v) if len(v) <= 60 else repr(v[:57]) + "..."
            kinds = "letters and digits of any script" if match_value else "letters, digits"
            self.fail(line, where, f"{shown} is not a valid name ({kinds}, '_', '.', '-')")
            return False
        return True
