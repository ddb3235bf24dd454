"""Read YAML into plain values that remember their line numbers.

PyYAML's ``safe_load`` loses positions and silently keeps the last of two duplicate keys.
Composing the node graph and converting it ourselves gives every mapping key its line,
turns duplicates into errors, refuses non-standard tags (``!!python/object`` and friends)
and bounds alias expansion so an "alias bomb" cannot eat memory.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_NODES = 200_000
MAX_BYTES = 4 << 20

_SAFE_TAGS = {
    "tag:yaml.org,2002:str",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:null",
    "tag:yaml.org,2002:seq",
    "tag:yaml.org,2002:map",
}


class YamlError(Exception):
    """A YAML-level fault with the 1-based line where it was found."""

    def __init__(self, line: int | None, key: str, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.key = key
        self.message = message


class LocatedDict(dict[Any, Any]):
    """A mapping that knows its own line and the line of each key."""

    line: int
    key_lines: dict[Any, int]


class LocatedList(list[Any]):
    """A sequence that knows its own line and the line of each item."""

    line: int
    item_lines: list[int]


def line_of(value: object, default: int | None = None) -> int | None:
    return getattr(value, "line", default)


def parse(text: str) -> Any:
    """Parse one YAML document; raise :class:`YamlError` for anything we refuse."""
    if len(text) > MAX_BYTES:
        raise YamlError(None, "", f"file is {len(text)} characters; a table may have at most {MAX_BYTES}")
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
