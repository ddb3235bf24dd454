"""A checkpoint directory's index: the one reader of ``model.safetensors.index.json`` (no torch).

Why here, below the tools: ``plan`` and ``tune`` (tools) and the tiny checkpoint's loader (core)
all follow a sharded checkpoint's index, so its reader must sit where each of them may import it.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import jsonread
from ..files import ReadRefused, read_regular
from ..problems import printable

INDEX_NAME = "model.safetensors.index.json"
"""A sharded checkpoint's map of tensor name -> shard file (Hugging Face's name)."""
MAX_INDEX = 64 * 1024 * 1024
"""Largest model.safetensors.index.json read (a 1T-parameter model's is ~10 MB)."""


def checkpoint_index(directory: str | os.PathLike[str]) -> tuple[dict[str, str] | None, list[str]]:
    """``model.safetensors.index.json``'s ``weight_map`` (tensor name -> shard file), read the one way
    (bounded, regular file, finite JSON), and what is wrong with it; ``None`` when there is no index
    or it is unusable. Entries that are not strings are left out (and named as a problem).

    Why one reader: ``plan`` (shapes from the shards' headers), ``tune`` (the expert tensors) and
    the tiny checkpoint's loader all follow the index; each had its own parse with its own checks.
    """
    index = Path(directory) / INDEX_NAME
    if not os.path.lexists(index):
        return None, []
    try:
        data = jsonread.loads(read_regular(index, MAX_INDEX, expected="a JSON file"))
    except (ReadRefused, jsonread.JsonRefused) as exc:
        line = f":{exc.line}" if isinstance(exc, jsonread.JsonRefused) and exc.line else ""
        return None, [f"{printable(str(index))}{line}: not a readable index: {printable(str(exc))}"]
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        return None, [f"{printable(str(index))}: weight_map: expected a mapping of tensor name to shard file"]
    problems = []
    if any(not isinstance(v, str) for v in weight_map.values()):
        problems.append(f"{printable(str(index))}: weight_map: expected shard file names (strings); "
                        "other entries ignored")
    return {k: v for k, v in weight_map.items() if isinstance(k, str) and isinstance(v, str)}, problems
