"""The one reader of a checkpoint's tensors (:func:`quantreg.models.checkpoint.read_tensors`), on real
safetensors files: tune's expert and dense measurements both read through it (issue 47), so what it
refuses (a name the index lacks, a shard outside the checkpoint, a FIFO, a broken index) it refuses
for both, located."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from quantreg.models.checkpoint import INDEX_NAME, SINGLE_FILE, read_tensors  # noqa: E402


def _sharded(root: Path) -> dict[str, torch.Tensor]:
    """Two shards and their index: ``a`` in the first, ``b`` (int8) in the second."""
    a = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    b = torch.tensor([1, -2, 3], dtype=torch.int8)
    safetensors_torch.save_file({"a": a}, str(root / "model-00001.safetensors"))
    safetensors_torch.save_file({"b": b}, str(root / "model-00002.safetensors"))
    (root / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "model-00001.safetensors",
                                                              "b": "model-00002.safetensors"}}))
    return {"a": a, "b": b}


def test_reads_named_tensors_across_shards_as_stored(tmp_path: Path) -> None:
    written = _sharded(tmp_path)
    read = read_tensors(tmp_path, ["b", "a"])
    assert list(read) == ["b", "a"]
    assert torch.equal(read["a"], written["a"]) and read["a"].dtype == torch.bfloat16
    assert torch.equal(read["b"], written["b"]) and read["b"].dtype == torch.int8  # no conversion: the caller's


def test_an_unsharded_checkpoint_is_its_one_file(tmp_path: Path) -> None:
    safetensors_torch.save_file({"w": torch.ones(2)}, str(tmp_path / SINGLE_FILE))
    assert torch.equal(read_tensors(tmp_path, ["w"])["w"], torch.ones(2))
    with pytest.raises(LookupError, match=rf"{SINGLE_FILE}: no tensor gone \(is it X\?\)$"):
        read_tensors(tmp_path, ["w", "gone"], hint=" (is it X?)")


def test_a_name_the_index_lacks_is_named_with_the_hint(tmp_path: Path) -> None:
    _sharded(tmp_path)
    with pytest.raises(LookupError, match=r"no tensor c in the checkpoint's index \(is it GPT-OSS MXFP4\?\)"):
        read_tensors(tmp_path, ["a", "c"], hint=" (is it GPT-OSS MXFP4?)")


def test_a_shard_outside_the_checkpoint_is_never_read(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    root.mkdir()
    safetensors_torch.save_file({"a": torch.ones(1)}, str(tmp_path / "elsewhere.safetensors"))
    (root / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "../elsewhere.safetensors"}}))
    with pytest.raises(LookupError, match=r"names '\.\./elsewhere\.safetensors' for a, outside the checkpoint"):
        read_tensors(root, ["a"])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_shard_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / SINGLE_FILE)
    with pytest.raises(LookupError, match=rf"{SINGLE_FILE}: .*safetensors file"):
        read_tensors(tmp_path, ["w"])


def test_a_broken_index_is_the_first_problem_located(tmp_path: Path) -> None:
    (tmp_path / INDEX_NAME).write_text('{"weight_map": [1, 2]}')
    with pytest.raises(LookupError, match=rf"{INDEX_NAME}: weight_map: expected a mapping"):
        read_tensors(tmp_path, ["a"])
