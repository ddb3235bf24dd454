"""YAML rule tables (schema version 1) → :class:`TableFile` values, with located problems.

Every schema check lives here so the CLI, the vLLM seam and the JSON Schema describe the
same thing. A file with any problem contributes no rules (nothing half-applied).
"""

from __future__ import annotations

import dataclasses
import os
import re
from types import MappingProxyType
from typing import Any

from ..bounds import MAX_PRIORITY, whole_problem
from ..keys import EXPERTS, Match
from ..methods import Method
from ..problems import Problem, quantreg_logger, type_name
from . import cache as tablecache
from .located import MAX_BYTES, ReadRefused, YamlError, gc_paused, line_of, read_regular_file
from .located import file_identity as _file_identity
from .match import MatchChecker
from .methods import parse_methods
from .rules import Rule, TableFile, TableHeader, Tier, rule_json

__all__ = [
    "SCHEMA_VERSION",
    "Rule",
    "TableFile",
    "TableHeader",
    "TableRead",
    "Tier",
    "file_identity",
    "parse_table",
    "read_table",
    "rule_json",
]

SCHEMA_VERSION = 1
TOP_KEYS = ("version", "rules", "strict", "allow_import_targets", "methods")
RULE_KEYS = ("match", "method", "options", "priority", "note", "verify", "tuned")
logger = quantreg_logger("vllm.quantreg.table")
_LOGGED: set[tuple[str, int | None, str]] = set()
"""Deprecations already logged by this process: a table read again (validate, every Registry.build) says it once."""


class _Checker(MatchChecker):
    """A whole file: its top-level keys, each rule (the ``match:`` checks are :class:`MatchChecker`'s)."""

    def __init__(self, path: str, tier: Tier) -> None:
        super().__init__(path)
        self.tier = tier
        self.references: list[Rule] = []
        self.deprecations: list[Problem] = []

    def deprecated(self, line: int | None, key: str, message: str) -> None:
        """An old spelling, read as its new one: one located WARNING per process, kept on the header."""
        problem = Problem(self.path, line, key, message)
        self.deprecations.append(problem)
        if (self.path, line, key) not in _LOGGED:
            _LOGGED.add((self.path, line, key))
            logger.warning("quantreg: %s", problem)

    def table(self, doc: Any) -> tuple[TableFile | None, TableHeader | None]:
        """The table (``None`` on any problem) and its header (``None`` unless ``doc`` is a mapping)."""
        if doc is None:
            self.fail(1, "", "empty file: expected a mapping with 'version: 1' and 'rules'")
            return None, None
        if not isinstance(doc, dict):
            self.fail(line_of(doc, 1), "", f"expected a mapping with 'version' and 'rules', got {type_name(doc)}")
            return None, None
        key_lines: dict[Any, int] = getattr(doc, "key_lines", {})
        self.unknown_keys(doc, TOP_KEYS, "")
        if "version" not in doc:
            self.fail(line_of(doc, 1), "version", f"missing; expected 'version: {SCHEMA_VERSION}'")
        else:
            version = doc["version"]
            if isinstance(version, bool) or version != SCHEMA_VERSION:
                self.fail(
                    key_lines.get("version"),
                    "version",
                    f"unsupported schema version {version!r}; this quantreg reads version {SCHEMA_VERSION}",
                )
        strict = doc.get("strict")
        if strict is not None and not isinstance(strict, bool):
            self.fail(key_lines.get("strict"), "strict", f"expected true or false, got {type_name(strict)}")
            strict = None
        allow = doc.get("allow_import_targets", False)
        if not isinstance(allow, bool):
            self.fail(key_lines.get("allow_import_targets"), "allow_import_targets",
                      f"expected true or false, got {type_name(allow)}")
            allow = False
        methods: tuple[Method, ...] = ()
        if "methods" in doc:
            methods = parse_methods(doc["methods"], line=key_lines.get("methods"), allowed=allow,
                                    user_tier=self.tier >= Tier.USER, plugin_name=f"table {self.path}",
                                    fail=self.fail)
        rules: list[Rule] = []
        if "rules" not in doc:
            self.fail(line_of(doc, 1), "rules", "missing; expected a list of rules")
        elif not isinstance(doc["rules"], list):
            self.fail(key_lines.get("rules"), "rules", f"expected a list of rules, got {type_name(doc['rules'])}")
        else:
            raw = doc["rules"]
            item_lines = getattr(raw, "item_lines", [])
            for i, item in enumerate(raw):
                line = item_lines[i] if i < len(item_lines) else line_of(raw, 1) or 1
                rule = self.rule(item, f"rules[{i}]", line)
                if rule is not None:
                    rules.append(rule)
        version = doc.get("version")
        readable = isinstance(version, int) and not isinstance(version, bool)
        header = TableHeader(self.path, self.tier, version if readable else None, strict, allow,
                             deprecations=tuple(self.deprecations))
        if self.problems:
            header = dataclasses.replace(header, references=tuple(self.references),
                                         own_methods=tuple(m.name for m in methods))
            return None, header
        method_lines = MappingProxyType(dict(getattr(doc.get("methods"), "key_lines", {})))
        return TableFile(self.path, self.tier, tuple(rules), strict, methods, allow, method_lines), header

    def rule(self, item: Any, where: str, line: int) -> Rule | None:
        if not isinstance(item, dict):
            self.fail(line, where, f"expected a mapping with 'match' and 'method', got {type_name(item)}")
            return None
        before = len(self.problems)
        key_lines: dict[Any, int] = getattr(item, "key_lines", {})
        self.unknown_keys(item, RULE_KEYS, where)
        match = self.match(item.get("match"), f"{where}.match", key_lines.get("match", line), "match" in item)
        methods, method_lines = self.methods(item.get("method"), f"{where}.method", key_lines.get("method", line),
                                             "method" in item)
        options = item.get("options", {})
        if options is None:
            options = {}
        if not isinstance(options, dict):
            self.fail(key_lines.get("options"), f"{where}.options", f"expected a mapping, got {type_name(options)}")
        else:
            for k in options:
                if not isinstance(k, str):
                    self.fail(key_lines.get("options"), f"{where}.options", f"option names must be strings, got {k!r}")
        priority = item.get("priority", 0)
        problem = whole_problem(priority, -MAX_PRIORITY, MAX_PRIORITY, "an integer")
        if problem:
            self.fail(key_lines.get("priority"), f"{where}.priority", problem)
        note = item.get("note", "")
        if not isinstance(note, str):
            self.fail(key_lines.get("note"), f"{where}.note", f"expected a string, got {type_name(note)}")
        verify = None
        if "verify" in item:
            from .verify import FLOAT64_FORMATS, parse_verify

            verify = parse_verify(item["verify"], f"{where}.verify", key_lines.get("verify", line), self.fail,
                                  # a broken match is reported already; do not add a float64 complaint to it
                                  match.quant_format if match is not None and EXPERTS in match.layers
                                  else FLOAT64_FORMATS,  # a dense layer's float64 is its own weight
                                  deprecated=self.deprecated)
        tuned = None
        if "tuned" in item:
            from .tuned import parse_tuned

            tuned = parse_tuned(item["tuned"], f"{where}.tuned", key_lines.get("tuned", line), self.fail)
        if len(self.problems) > before or match is None:
            if methods:  # the name and reference checks still apply to what could be read
                self.references.append(Rule(
                    match=match or Match(), methods=methods, path=self.path, line=line, tier=self.tier,
                    options=MappingProxyType(_plain(options) if isinstance(options, dict) else {}),
                    method_lines=method_lines, options_line=key_lines.get("options"), where=where,
                    verify=verify, verify_line=key_lines.get("verify")))
            return None
        self.references.append(rule := Rule(
            match=match,
            methods=methods,
            path=self.path,
            line=line,
            tier=self.tier,
            priority=priority,
            options=MappingProxyType(_plain(options)),
            note=note,
            method_lines=method_lines,
            options_line=key_lines.get("options"),
            where=where,
            verify=verify,
            verify_line=key_lines.get("verify"),
            tuned=tuned,
        ))
        return rule

    def methods(self, raw: Any, where: str, line: int, present: bool) -> tuple[tuple[str, ...], tuple[int, ...]]:
        if not present:
            self.fail(line, where, "missing; expected a method name or a list of names (a fallback chain)")
            return (), ()
        if isinstance(raw, str):
            return ((raw,), (line,)) if self.name(raw, line, where) else ((), ())
        if isinstance(raw, list):
            if not raw:
                self.fail(line, where, "empty chain; expected at least one method name")
                return (), ()
            lines = getattr(raw, "item_lines", [line] * len(raw))
            names: list[str] = []
            for i, x in enumerate(raw):
                if not isinstance(x, str):
                    self.fail(lines[i], f"{where}[{i}]", f"expected a method name, got {type_name(x)}")
                elif x in names:
                    self.fail(lines[i], f"{where}[{i}]", f"method '{x}' appears twice in the chain")
                elif self.name(x, lines[i], f"{where}[{i}]"):
                    names.append(x)
            return tuple(names), tuple(lines)
        self.fail(line, where, f"expected a method name or a list of names, got {type_name(raw)}")
        return (), ()


def _plain(value: Any) -> Any:
    """Strip line bookkeeping so options handed to methods are ordinary dicts and lists."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


TableRead = tuple[TableFile | None, list[Problem], TableHeader | None]
"""(table or ``None`` on any problem, every problem found, header or ``None`` if not a mapping)."""


def parse_table(text: str, path: str, tier: Tier) -> TableRead:
    """Check one table's text; on any problem the table is ``None``, the header kept if readable."""
    try:
        doc = tablecache.parse(text, cache=tier in (Tier.DEFAULT, Tier.PLUGIN))
    except YamlError as exc:
        return None, [Problem(path, exc.line, exc.key, exc.message)], None
    except Exception as exc:  # a parser fault we did not foresee is still this file's problem, not a crash
        return None, [Problem(path, None, "", f"cannot read this table ({_fault(exc)})")], None
    checker = _Checker(path, tier)
    try:
        with gc_paused():  # tens of thousands of Rule/Match objects, no cycles (see gc_paused)
            table, header = checker.table(doc)
    except Exception as exc:  # likewise for the checks: located problems only, never a traceback
        return None, [*checker.problems, Problem(path, None, "", f"cannot check this table ({_fault(exc)})")], None
    return table, checker.problems, header


def _fault(exc: BaseException) -> str:
    """``TypeName: text`` of an exception whose ``__str__`` may itself fail or be huge."""
    try:
        text = str(exc)
    except Exception:
        text = ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


_RAW_STRICT = re.compile(rb"^strict[ \t]*:[ \t]*(true|True|TRUE)[ \t]*(#[^\r\n]*)?\r?$", re.MULTILINE)


def raw_strict(data: bytes) -> bool:
    """Does the raw text hold a top-level ``strict: true`` line (column 0, optional comment)?

    The fallback for a file whose YAML cannot be read (a syntax error, a duplicate key, a
    timestamp, a non-UTF-8 byte, a control character), which has no header: its request for
    strict mode must still be honoured, or a broken table would start a server leniently. A
    file is read at most :data:`MAX_BYTES` + 1 bytes, so the scan is bounded; erring towards
    strict is the safe side (a spurious match fails start-up loudly, a missed one would not).
    """
    return _RAW_STRICT.search(data) is not None


def _with_raw_header(read: TableRead, data: bytes, path: str, tier: Tier) -> TableRead:
    """``read`` with a header from :func:`raw_strict` when parsing gave none (see there)."""
    table, problems, header = read
    if header is None and problems and tier >= Tier.USER and raw_strict(data):
        header = TableHeader(path, tier, strict=True)
    return table, problems, header


def read_table(path: str | os.PathLike[str], tier: Tier) -> TableRead:
    """Read and check one file; unreadable, non-UTF-8, missing and non-regular files are problems too.

    Only a regular file is read, and at most :data:`MAX_BYTES` + 1 bytes of it (see
    :func:`quantreg.table.located.read_regular_file`): a FIFO, ``/dev/stdin`` or ``/dev/zero`` named in
    ``QUANTREG_CONFIG`` is a located problem, not a hang or gigabytes of memory.
    """
    try:
        shown = os.fspath(path)
    except TypeError:
        shown = repr(path)
    try:
        data = read_regular_file(path, MAX_BYTES)
    except ReadRefused as exc:
        return None, [Problem(shown, None, "", str(exc))], None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        problem = Problem(shown, line, "", f"not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})")
        return _with_raw_header((None, [problem], None), data, shown, tier)
    return _with_raw_header(parse_table(text, shown, tier), data, shown, tier)


def file_identity(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of a table path, so one file reached by two paths is one table.

    See :func:`quantreg.table.located.file_identity`; ``None`` when the path cannot be stat'ed (it is
    then read, and reported, on its own).
    """
    return _file_identity(path)

