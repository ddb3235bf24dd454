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

from .located import MAX_BYTES, MAX_NODES, LocatedDict, LocatedList, YamlError, gc_paused, line_of

__all__ = ["MAX_BYTES", "MAX_NODES", "LocatedDict", "LocatedList", "YamlError", "gc_paused", "line_of", "parse"]

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
    if _fast_path_safe(text):
        try:
            with gc_paused():
                return _parse_fast(text)
        except Exception:  # any problem: say it exactly as the pure-Python loader does, below
            pass
    return _parse_pure(text)


def _parse_pure(text: str) -> Any:
    """The reference path: PyYAML's pure-Python composer, which also words every error."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
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
    if node is None:
        return None
    return _Converter().convert(node, "")


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
        return _build(loader)
    finally:
        loader.dispose()


def _build(loader: Any) -> Any:
    """One flat loop over the events, a stack of open collections (no recursion, no nodes)."""
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
    count = 0
    stack: list[tuple[Any, bool, Any, bool, int]] = []
    current: Any = None  # the open LocatedDict / LocatedList
    in_map = have_key = False
    key: Any = None
    while True:
        event = get()
        kind = type(event)
        if kind is scalar_event:
            count += 1
            if event.anchor is not None or count > MAX_NODES:
                raise _Refused
            tag = event.tag
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
            else:
                raise _Refused
            line = event.start_mark.line + 1
        elif kind is mapping_start or kind is sequence_start:
            count += 1
            if event.anchor is not None or count > MAX_NODES or (in_map and not have_key):
                raise _Refused  # an anchor, too many nodes, or a collection used as a mapping key
            tag = event.tag
            if tag is None:
                tag = resolve(yaml.MappingNode if kind is mapping_start else yaml.SequenceNode, None, event.implicit)
            if tag not in _SAFE_TAGS:
                raise _Refused
            line = event.start_mark.line + 1
            stack.append((current, in_map, key, have_key, line))
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
            current, in_map, key, have_key, line = stack.pop()
        else:
            raise _Refused  # an alias, or an event this builder does not expect
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


class _Converter:
    def __init__(self) -> None:
        self.count = 0
        self.constructor = yaml.SafeLoader("")

    def convert(self, node: yaml.Node, path: str) -> Any:
        self.count += 1
        line = node.start_mark.line + 1
        if self.count > MAX_NODES:
            raise YamlError(line, path, f"document expands to more than {MAX_NODES} nodes (alias bomb?)")
        if node.tag not in _SAFE_TAGS:
            raise YamlError(line, path, f"tag {node.tag!r} is not allowed; tables hold plain YAML only")
        if isinstance(node, yaml.MappingNode):
            out = LocatedDict()
            out.line = line
            out.key_lines = {}
            for knode, vnode in node.value:
                if knode.tag == "tag:yaml.org,2002:merge":
                    raise YamlError(knode.start_mark.line + 1, path, "merge keys ('<<') are not supported")
                key = self.convert(knode, path)
                kline = knode.start_mark.line + 1
                if isinstance(key, (dict, list)):
                    raise YamlError(kline, path, "mapping keys must be plain scalars")
                sub = f"{path}.{key}" if path else str(key)
                if key in out:
                    raise YamlError(
                        kline, sub, f"duplicate key (first at line {out.key_lines[key]}); YAML would keep only the last"
                    )
                out.key_lines[key] = kline
                out[key] = self.convert(vnode, sub)
            return out
        if isinstance(node, yaml.SequenceNode):
            seq = LocatedList()
            seq.line = line
            seq.item_lines = []
            for i, item in enumerate(node.value):
                seq.item_lines.append(item.start_mark.line + 1)
                seq.append(self.convert(item, f"{path}[{i}]"))
            return seq
        try:
            return self.constructor.construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            raise YamlError(line, path, f"cannot read value: {exc}") from None
