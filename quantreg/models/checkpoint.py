"""A checkpoint directory's index and tensors: the one reader of ``model.safetensors.index.json``
(no torch) and the one reader of named tensors from its shards (imports safetensors when called).

Why here, below the tools: ``plan`` and ``tune`` (tools) and the tiny checkpoint's loader (core)
all follow a sharded checkpoint's index, so its reader must sit where each of them may import it;
``tune``'s two measurements (the experts and the dense layers) each had their own copy of the
tensor reader, with the same checks (index followed, shard inside the checkpoint, regular file).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from .. import jsonread
from ..files import ReadRefused, read_regular
from ..problems import printable

if TYPE_CHECKING:  # torch is imported by safetensors when tensors are read, never by listing the index
    import torch

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


SINGLE_FILE = "model.safetensors"
"""An unsharded checkpoint's one file (no index)."""


def read_tensors(directory: str | os.PathLike[str], names: Iterable[str], *, hint: str = "") -> dict[str, torch.Tensor]:
    """The tensors ``names`` names, as stored, read from the checkpoint's shards (index followed,
    :func:`checkpoint_index`; :data:`SINGLE_FILE` without one). ``hint`` is appended to a "no
    tensor" message (``" (is it GPT-OSS MXFP4?)"``: what the caller expected the checkpoint to be).

    Raises ``LookupError`` naming the file and the tensor: the index unusable, a name missing from
    the index or its shard, a shard named outside the checkpoint (``../x`` must never make quantreg
    read elsewhere) or not a regular file (safetensors' own open would block on a FIFO and map
    ``/dev/zero``). Converting or reshaping is the caller's: each knows what it reads.
    """
    from safetensors import safe_open

    from ..files import inside, require_regular

    root = Path(directory)
    weight_map, problems = checkpoint_index(root)
    if problems:
        raise LookupError(problems[0])
    out: dict[str, torch.Tensor] = {}
    for name in names:
        shard_name = weight_map.get(name) if weight_map is not None else SINGLE_FILE
        if shard_name is None:
            raise LookupError(f"{printable(str(root))}: no tensor {name} in the checkpoint's index{hint}")
        shard = inside(root, shard_name)
        if shard is None:
            raise LookupError(f"{printable(str(root))}: the index names {printable(repr(shard_name))} for {name}, "
                              "outside the checkpoint")
        try:
            require_regular(shard, expected="a safetensors file")
        except ReadRefused as exc:
            raise LookupError(f"{printable(shard)}: {exc}") from None
        with safe_open(shard, framework="pt") as handle:
            if name not in handle.keys():
                raise LookupError(f"{printable(shard)}: no tensor {name}{hint}")
            out[name] = handle.get_tensor(name)
    return out
