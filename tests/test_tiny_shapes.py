"""``quantreg tiny-model --shape``: the 20B preset is GPT-OSS-20B's real configuration, and the
streaming (sharded) writer gives the same weights as the one-file writer, one shard per layer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from quantreg.models.gpt_oss import CHAT_VOCAB, GPT_OSS_20B, SHAPES, tiny_gpt_oss_config


def test_20b_preset_is_the_published_config() -> None:
    """Field for field what openai/gpt-oss-20b's config.json says (sizes, attention, rope/yarn)."""
    config = tiny_gpt_oss_config(**GPT_OSS_20B)
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (2880, 2880, 24)
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["experts_per_token"]) == (32, 4, 4)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (64, 8, 64)
    assert config["vocab_size"] == CHAT_VOCAB == 201088
    assert config["sliding_window"] == 128
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 12
    assert config["rope_theta"] == 150000
    assert config["rope_scaling"] == {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                      "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                      "truncate": False}
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert config["swiglu_limit"] == 7.0
    assert set(SHAPES) == {"tiny", "20b"}


def test_chunked_draws_equal_one_draw() -> None:
    """Real-size tensors are drawn a slice of rows at a time: the values must not depend on it."""
    torch = pytest.importorskip("torch")
    from quantreg.tiny import checkpoint

    shape = (8, 6, 4, 16)
    whole = {}
    for chunk in (1 << 30, 400):  # one draw; then slices of a few rows
        old = checkpoint._CHUNK_ELEMENTS
        checkpoint._CHUNK_ELEMENTS = chunk
        try:
            gen = torch.Generator().manual_seed(3)
            whole[chunk] = (checkpoint._mxfp4_blocks(shape, gen), checkpoint._e8m0_scales(shape[:3], 64, gen),
                            checkpoint._normal(shape, 0.5, gen))
        finally:
            checkpoint._CHUNK_ELEMENTS = old
    for a, b in zip(whole[1 << 30], whole[400]):
        assert torch.equal(a, b)


def test_sharded_writer_streams_the_same_weights(tmp_path: Path) -> None:
    """One shard per group (head, then each layer) plus the index vLLM and llama.cpp read; the
    tensors equal the one-file checkpoint of the same seed; progress says each shard."""
    torch = pytest.importorskip("torch")
    from quantreg.tiny.checkpoint import INDEX_NAME, load_tensors, write_tiny_gpt_oss

    lines: list[str] = []
    sharded = write_tiny_gpt_oss(tmp_path / "sharded", seed=5, sharded=True, progress=lines.append, layers=3)
    single = write_tiny_gpt_oss(tmp_path / "single", seed=5, layers=3)
    index = json.loads((sharded / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    assert index["weight_map"]["lm_head.weight"] == shards[0]
    assert index["weight_map"]["model.layers.2.mlp.experts.down_proj_blocks"] == shards[3]
    assert len(lines) == 4 and lines[0].startswith("[1/4] head: ") and lines[3].startswith("[4/4] layer 2: ")
    a, b = load_tensors(sharded), load_tensors(single)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in a.values())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((sharded / "config.json").read_text()) == json.loads((single / "config.json").read_text())


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "quantreg", "tiny-model", *args], capture_output=True, text=True,
                          timeout=300, check=False)


def test_cli_layers_option_and_json(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    proc = _cli(str(tmp_path / "m"), "--layers", "3", "--seed", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert (data["shape"], data["layers"], data["quantization"]) == ("tiny", 3, "mxfp4")
    assert "model.safetensors" in data["files"] and data["bytes"] > 0
    assert proc.stderr == ""  # --json: no progress lines


@pytest.mark.parametrize("layers", ["0", "1000000"])
def test_cli_refuses_a_layer_count_out_of_bounds(tmp_path: Path, layers: str) -> None:
    """Before torch is imported or anything allocated (a million layers used to allocate until memory ran out)."""
    proc = _cli(str(tmp_path / "m"), "--shape", "20b", "--layers", layers)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"quantreg tiny-model: error: argument --layers: expected a layer count from 1 to 256, got string '{layers}'")
    assert not (tmp_path / "m").exists()


def test_a_library_caller_gets_the_same_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from quantreg.tiny.command import tiny_model_command

    assert tiny_model_command(str(tmp_path / "m"), layers=0) == 2
    assert capsys.readouterr().err.strip() == (
        "quantreg tiny-model: --layers: expected a layer count from 1 to 256, got integer 0")
    assert not (tmp_path / "m").exists()
