"""Read YAML into plain values that remember their line numbers.

PyYAML's ``safe_load`` loses positions and silently keeps the last of two duplicate keys.
Composing the node graph and converting it ourselves gives every mapping key its line,
turns duplicates into errors, refuses non-standard tags (``!!python/object`` and friends)
and bounds alias expansion so an "alias bomb" cannot eat memory.

Speed (a 10,000-rule table must load in well under a second; the pure-Python loader took ~10 s):
when PyYAML has libyaml, the located values are built straight from libyaml's event stream (no
node graph), scalar tags are resolved once per distinct value, and the garbage collector is
paused while the (acyclic) values are built, because collections triggered by ~10^6 new objects
cost more than the parsing. Only a clean file takes this path: any problem at all (and any text
on which the two parsers are known to differ) is parsed again by the pure-Python loader, so every
error message and line is exactly the pure-Python one, and so is every accepted value.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from .located import (
    MAX_BYTES,
    MAX_DEPTH,
    MAX_INT_BITS,
    MAX_NODES,
    LocatedDict,
    LocatedList,
    YamlError,
    gc_paused,
    line_of,
)

__all__ = ["MAX_BYTES", "MAX_DEPTH", "MAX_NODES", "LocatedDict", "LocatedList", "YamlError", "gc_paused", "line_of",
           "parse"]

PURE_MAX_CHARS = 256 << 10
"""Above this size a document the fast path refused is composed from libyaml's events instead of
PyYAML's pure-Python scanner (which takes ~10 s per MiB): error wording may then be libyaml's."""

_SAFE_TAGS = {
    "tag:yaml.org,2002:str",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:null",
    "tag:yaml.org,2002:seq",
    "tag:yaml.org,2002:map",
}


def parse(text: str) -> Any:
    """Parse one YAML document; raise :class:`YamlError` for anything we refuse."""
    if len(text) > MAX_BYTES:
        raise YamlError(None, "", f"file is {len(text)} characters; a table may have at most {MAX_BYTES}")
    safe = _fast_path_safe(text)
    if safe:
        try:
            with gc_paused():
                return _parse_fast(text)
        except YamlError:  # a bound broken in a large text, already located (see _build)
            raise
        except Exception:  # any problem: say it exactly as the pure-Python loader does, below
            pass
    return _parse_pure(text, _CEventLoader if safe and len(text) > PURE_MAX_CHARS else _PureLoader)


class _Bounded:
    """Composer mix-in: nesting bounded by :data:`MAX_DEPTH`, and each alias remembers where it was written.

    PyYAML's composer recurses once per level (a ``RecursionError`` at ~1,000) and hands back the
    anchor's own node for an alias, so a rule repeated through ``*alias`` would be reported at the
    anchor's line. Here an alias yields a shallow copy of the anchored node carrying the alias's
    position, marked so the converter counts what it expands (the alias-bomb bound).
    """

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        loader: Any = self
        if loader.check_event(yaml.AliasEvent):
            event = loader.peek_event()
            node = super().compose_node(parent, index)  # type: ignore[misc]
            copy = type(node)(node.tag, node.value, event.start_mark, event.end_mark)
            copy.qr_alias = True
            return copy
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                event = loader.peek_event()
                raise YamlError(event.start_mark.line + 1, "",
                                f"nested more than {MAX_DEPTH} levels deep; a table needs far fewer")
            return super().compose_node(parent, index)  # type: ignore[misc]
        finally:
            self._depth -= 1


class _PureLoader(_Bounded, yaml.SafeLoader):
    """PyYAML's reference (pure-Python) loader, bounded."""


_CEventLoader: Any = _PureLoader  # PyYAML without libyaml: the pure loader is all there is
_CParserBase: Any = getattr(getattr(yaml, "cyaml", None), "CParser", None)
if _CParserBase is not None:
    class _CEvents(_Bounded, yaml.composer.Composer, yaml.constructor.SafeConstructor,
                   yaml.resolver.Resolver, _CParserBase):  # type: ignore[misc]
        """libyaml's scanner and parser, PyYAML's (bounded) composer: fast for large documents."""

        def __init__(self, stream: str) -> None:
            _CParserBase.__init__(self, stream)
            yaml.composer.Composer.__init__(self)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)

    _CEventLoader = _CEvents


def _parse_pure(text: str, loader_class: Any = None) -> Any:
    """The reference path: PyYAML's composer (bounded), which also words every error."""
    loader: Any = None
    try:
        loader = (loader_class or _PureLoader)(text)  # the reader checks characters here already
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        what = exc.problem or str(exc)
        if exc.context:
            what = f"{exc.context}, {what}"
        raise YamlError(line, "", f"YAML syntax error: {what}") from None
    except yaml.reader.ReaderError as exc:  # a control character: no mark, but a position in ``text``
        line = text.count("\n", 0, exc.position) + 1
        raise YamlError(line, "", f"unacceptable character #x{exc.character:04x}: {exc.reason}") from None
    except yaml.YAMLError as exc:
        raise YamlError(None, "", f"YAML error: {exc}") from None
    except RecursionError:  # not expected with the depth bound; never a traceback all the same
        raise YamlError(None, "", f"nested too deeply (more than {MAX_DEPTH} levels)") from None
    finally:
        if loader is not None:
            loader.dispose()
    if node is None:
        return None
    return _Converter().convert(node, "", 1, None)


# Text on which libyaml and pure PyYAML are known to disagree (found by differential fuzzing):
# libyaml accepts tabs after tokens, '?' inside flow scalars and a block-scalar header followed
# directly by '#', all of which PyYAML refuses; it drops a byte-order mark anywhere, PyYAML only
# at the start; PyYAML also counts NEL, LS and PS as line breaks. Such text (rare in tables) goes
# to the pure path, which stays the definition of what is valid.
_FAST_UNSAFE = re.compile("[\t?\x85\u2028\u2029]|[|>][-+0-9]*#|(?!\\A)\ufeff")
_CParser: Any = getattr(yaml, "CSafeLoader", None)  # None when PyYAML was built without libyaml
_STR_TAG = "tag:yaml.org,2002:str"
_SCALAR_TAGS: dict[tuple[str, bool, bool], str] = {}  # (value, plain, quoted) -> resolved tag
_SCALAR_TAGS_MAX = 1 << 16


class _Refused(Exception):
    """The fast path met something it leaves to the pure path (which words any error)."""


def _fast_path_safe(text: str) -> bool:
    return (_CParser is not None and not yaml.SafeLoader.yaml_path_resolvers
            and _FAST_UNSAFE.search(text) is None
            and yaml.reader.Reader.NON_PRINTABLE.search(text) is None)


def _parse_fast(text: str) -> Any:
    """Build the located values straight from libyaml's event stream, with no node graph.

    It gives what ``_Converter`` gives on a clean document (same values, types, lines, key order)
    and refuses (:class:`_Refused`) whatever it would have to explain: anchors and aliases, tags
    outside the safe set, merge keys, non-scalar or duplicate keys, a second document. Tags are
    resolved by PyYAML's own ``SafeLoader`` resolver, memoised per distinct scalar (a tag depends
    only on kind, value and implicitness when there are no path resolvers).
    """
    loader = _CParser(text)
    try:
        return _build(loader, len(text) <= PURE_MAX_CHARS)
    finally:
        loader.dispose()


def _build(loader: Any, exact: bool) -> Any:
    """One flat loop over the events, a stack of open collections (no recursion, no nodes).

    Anchors and aliases are handled here too: an alias is the anchored value (a shallow copy of a
    collection, carrying the alias's line, like :class:`_Converter`'s), its subtree size counted
    against the alias-bomb bound and its height against :data:`MAX_DEPTH`. A bound broken is left
    to the pure path when ``exact`` (a small text, so its wording is the reference one); in a large
    text it is reported here at the alias's line, so a 4 MB bomb does not go to a slow composer.
    """
    events = yaml.events
    scalar_event, mapping_start, sequence_start = (events.ScalarEvent, events.MappingStartEvent,
                                                   events.SequenceStartEvent)
    get = loader.get_event
    get()  # StreamStartEvent
    first = get()
    if type(first) is events.StreamEndEvent:
        return None  # no document at all (empty, or only comments)
    if type(first) is not events.DocumentStartEvent:
        raise _Refused
    resolve, memo, constructor = loader.resolve, _SCALAR_TAGS, None
    first_chars = loader.yaml_implicit_resolvers  # first character -> resolvers (PyYAML's own table)
    stack: list[tuple[Any, bool, Any, bool, int, Any]] = []
    anchors: dict[str, Any] = {}
    measured: dict[int, tuple[int, int]] = {}  # id(anchored value) -> (nodes, height)
    expanded = 0
    anchor: Any = None
    current: Any = None  # the open LocatedDict / LocatedList
    in_map = have_key = False
    key: Any = None
    while True:
        event = get()
        kind = type(event)
        if kind is scalar_event:
            if len(stack) >= MAX_DEPTH:
                raise _Refused
            tag = event.tag
            if tag is None and event.implicit[0] and event.value and event.value[0] not in first_chars:
                tag = _STR_TAG  # what resolve() answers when no implicit resolver starts with this character
            if tag is None:
                implicit = event.implicit
                memo_key = (event.value, implicit[0], implicit[1])
                tag = memo.get(memo_key)
                if tag is None:
                    tag = resolve(yaml.ScalarNode, event.value, implicit)
                    if len(memo) < _SCALAR_TAGS_MAX:
                        memo[memo_key] = tag
            if tag == _STR_TAG:  # (the non-specific tag '!' is not in _SAFE_TAGS: the parsers differ on it)
                value: Any = event.value  # exactly SafeConstructor.construct_yaml_str
            elif tag in _SAFE_TAGS:  # int, float, bool, null (a collection tag on a scalar raises)
                if constructor is None:
                    constructor = yaml.SafeLoader("")
                node = yaml.ScalarNode(tag, event.value, event.start_mark, event.end_mark, event.style)
                value = constructor.construct_object(node, deep=True)
                if type(value) is int and value.bit_length() > MAX_INT_BITS:
                    raise _Refused
            else:
                raise _Refused
            line = event.start_mark.line + 1
            if event.anchor is not None:
                if event.anchor in anchors:
                    raise _Refused  # PyYAML refuses a duplicate anchor
                anchors[event.anchor] = value
        elif kind is mapping_start or kind is sequence_start:
            if len(stack) >= MAX_DEPTH or (in_map and not have_key) or event.anchor in anchors:
                raise _Refused  # too deep, a collection used as a mapping key, or a duplicate anchor
            tag = event.tag
            if tag is None:
                tag = resolve(yaml.MappingNode if kind is mapping_start else yaml.SequenceNode, None, event.implicit)
            if tag not in _SAFE_TAGS:
                raise _Refused
            line = event.start_mark.line + 1
            stack.append((current, in_map, key, have_key, line, anchor))
            anchor = event.anchor
            if kind is mapping_start:
                current = LocatedDict()
                current.key_lines = {}
            else:
                current = LocatedList()
                current.item_lines = []
            current.line = line
            in_map, have_key = kind is mapping_start, False
            continue
        elif kind is events.MappingEndEvent or kind is events.SequenceEndEvent:
            value = current
            if anchor is not None:
                anchors[anchor] = value
            current, in_map, key, have_key, line, anchor = stack.pop()
        elif kind is events.AliasEvent:
            if event.anchor not in anchors:
                raise _Refused  # undefined, or still open (a recursive alias): the pure path explains
            value = anchors[event.anchor]
            line = event.start_mark.line + 1
            size, height = measured.get(id(value)) or _measure(value, measured)
            expanded += size
            if expanded > MAX_NODES or len(stack) + 1 + height > MAX_DEPTH:
                if exact:
                    raise _Refused
                what = (f"aliases expand to more than {MAX_NODES} nodes (alias bomb?)" if expanded > MAX_NODES
                        else f"nested more than {MAX_DEPTH} levels deep (through aliases); a table needs far fewer")
                raise YamlError(line, "", what)
            if isinstance(value, LocatedDict):
                copy: Any = LocatedDict(value)
                copy.key_lines = value.key_lines
                copy.line, value = line, copy
            elif isinstance(value, LocatedList):
                copy = LocatedList(value)
                copy.item_lines = value.item_lines
                copy.line, value = line, copy
        else:
            raise _Refused  # an event this builder does not expect
        if current is None:  # the document's root value
            break
        if not in_map:
            current.item_lines.append(line)
            current.append(value)
        elif have_key:
            current[key] = value
            have_key = False
        else:
            if isinstance(value, (dict, list)) or value in current:
                raise _Refused  # a duplicate key
            key, have_key = value, True
            current.key_lines[key] = line
    if type(get()) is not events.DocumentEndEvent or type(get()) is not events.StreamEndEvent:
        raise _Refused  # more than one document
    return value


def _measure(value: Any, memo: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """(nodes, height) of a located value, keys counted as nodes, as :class:`_Converter` counts them.

    Iterative (no recursion) and memoised per collection, so each anchored tree is walked once.
    """
    if not isinstance(value, (LocatedDict, LocatedList)):
        return 1, 0
    found = memo.get(id(value))
    if found is not None:
        return found
    # post-order walk with an explicit stack
    work: list[tuple[Any, bool]] = [(value, False)]
    while work:
        item, done = work.pop()
        if id(item) in memo:
            continue
        children = list(item.values()) if isinstance(item, dict) else list(item)
        subs = [c for c in children if isinstance(c, (LocatedDict, LocatedList)) and id(c) not in memo]
        if not done and subs:
            work.append((item, True))
            work.extend((c, False) for c in subs)
            continue
        size, height = 1 + (len(item) if isinstance(item, dict) else 0), 0
        for child in children:
            csize, cheight = memo.get(id(child), (1, 0)) if isinstance(child, (LocatedDict, LocatedList)) else (1, 0)
            size += csize
            height = max(height, cheight + 1)
        memo[id(item)] = (size, height)
    return memo[id(value)]


class _Converter:
    """Composed nodes → located values. Recursion is bounded by :data:`MAX_DEPTH` (the composer's
    own bound does not cover aliases, which can nest an anchored tree inside itself)."""

    def __init__(self) -> None:
        self.expanded = 0  # nodes reached through an alias (beyond the anchor's own occurrence)
        self.constructor = yaml.SafeLoader("")

    def convert(self, node: yaml.Node, path: str, depth: int, via: int | None) -> Any:
        """``via`` is the line of the alias this node was reached through (outermost), if any:
        limits broken inside an aliased tree are reported there, where the expansion was asked for."""
        line = node.start_mark.line + 1
        if via is None and getattr(node, "qr_alias", False):
            via = line
        if via is not None:
            self.expanded += 1
            if self.expanded > MAX_NODES:
                raise YamlError(via, path, f"aliases expand to more than {MAX_NODES} nodes (alias bomb?)")
        if depth > MAX_DEPTH:
            raise YamlError(via or line, path, f"nested more than {MAX_DEPTH} levels deep (through aliases); "
                                               "a table needs far fewer")
        if node.tag not in _SAFE_TAGS:
            raise YamlError(line, path, f"tag {node.tag!r} is not allowed; tables hold plain YAML only")
        if isinstance(node, yaml.MappingNode):
            out = LocatedDict()
            out.line = line
            out.key_lines = {}
            for knode, vnode in node.value:
                if knode.tag == "tag:yaml.org,2002:merge":
                    raise YamlError(knode.start_mark.line + 1, path, "merge keys ('<<') are not supported")
                key = self.convert(knode, path, depth + 1, via)
                kline = knode.start_mark.line + 1
                if isinstance(key, (dict, list)):
                    raise YamlError(kline, path, "mapping keys must be plain scalars")
                sub = f"{path}.{key}" if path else str(key)
                if key in out:
                    raise YamlError(
                        kline, sub, f"duplicate key (first at line {out.key_lines[key]}); YAML would keep only the last"
                    )
                out.key_lines[key] = kline
                out[key] = self.convert(vnode, sub, depth + 1, via)
            return out
        if isinstance(node, yaml.SequenceNode):
            seq = LocatedList()
            seq.line = line
            seq.item_lines = []
            for i, item in enumerate(node.value):
                seq.item_lines.append(item.start_mark.line + 1)
                seq.append(self.convert(item, f"{path}[{i}]", depth + 1, via))
            return seq
        return self.scalar(node, path, line)

    def scalar(self, node: yaml.Node, path: str, line: int) -> Any:
        """Construct one scalar; any failure of construction (``!!int abc``, ``!!bool maybe``, an
        integer past Python's digit limit) is a located problem, never an exception."""
        try:
            value = self.constructor.construct_object(node, deep=True)
        except yaml.MarkedYAMLError as exc:  # its str() spans lines (a quoted snippet): keep the problem only
            raise YamlError(line, path, f"cannot read value: {exc.problem or exc.context}") from None
        except yaml.YAMLError as exc:
            raise YamlError(line, path, f"cannot read value: {_short(str(exc), 120, quote=False)}") from None
        except Exception as exc:  # ValueError, KeyError, OverflowError... from PyYAML's constructors
            tag = str(node.tag).rsplit(":", 1)[-1]
            digits = sum(c.isdigit() for c in str(node.value))
            if tag == "int" and digits > 100:  # Python's own text for it quotes its 4300-digit limit
                raise YamlError(line, path, f"integer too large ({digits:,} digits); tables hold small "
                                            "numbers") from None
            if tag == "bool":
                raise YamlError(line, path,
                                f"cannot read {_short(node.value)} as bool: expected true or false") from None
            raise YamlError(line, path, f"cannot read {_short(node.value)} as {tag}: "
                                        f"{_short(str(exc), 120, quote=False)}") from None
        if type(value) is int and value.bit_length() > MAX_INT_BITS:
            raise YamlError(line, path, f"integer too large (more than {MAX_INT_BITS} bits); tables hold small numbers")
        return value


def _short(value: Any, limit: int = 40, *, quote: bool = True) -> str:
    """A bounded, escaped rendering of a value for a message."""
    text = repr(value) if quote else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
