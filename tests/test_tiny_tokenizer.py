"""The tiny model's tokenizer: exact vocabulary size, special ids as in the checkpoint, round trips,
loading in transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantreg.tiny.tokenizer import BOS, EOS, PAD, TOKENIZER_FILES, build_tokenizer, write_tokenizer

TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "  leading spaces, tabs\tand\nnewlines  ",
    "unicode: é ü ß 漢字 ✓ 🙂",
    "",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the tiny checkpoint's own config.json (its vocab_size and special ids)."""
    from quantreg.models.gpt_oss import tiny_gpt_oss_config  # no torch

    out = tmp_path_factory.mktemp("tiny-tok")
    (out / "config.json").write_text(json.dumps(tiny_gpt_oss_config()))
    return write_tokenizer(out)


def test_files_and_vocabulary_match_the_tiny_config(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    for name in TOKENIZER_FILES:
        assert (model_dir / name).is_file()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = int(config["vocab_size"])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab
    assert tok.token_to_id(EOS) == config["eos_token_id"] == vocab - 1
    assert tok.token_to_id(PAD) == config["pad_token_id"] == vocab - 2
    assert tok.token_to_id(BOS) == vocab - 3
    assert max(tok.get_vocab().values()) == vocab - 1


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_with_tokenizers(model_dir: Path, text: str) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode(text).ids
    assert all(0 <= i < 1024 for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_merges_make_english_shorter_than_bytes(model_dir: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "The quick brown fox jumps over the lazy dog."
    assert len(tok.encode(text).ids) < 0.7 * len(text.encode())  # the learned merges are used


def test_loads_in_transformers_autotokenizer(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    assert len(tok) == 1024
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id) == (1021, 1022, 1023)
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    ids = tok("Hi" + EOS)["input_ids"]
    assert ids[-1] == 1023 and tok.decode(ids, skip_special_tokens=True) == "Hi"


def test_deterministic_and_refuses_a_too_small_vocabulary() -> None:
    assert build_tokenizer(512).to_str() == build_tokenizer(512).to_str()
    with pytest.raises(ValueError, match="no room"):
        build_tokenizer(200)


def test_tiny_model_command_writes_checkpoint_and_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from quantreg.tiny.command import tiny_model_command

    assert tiny_model_command(str(tmp_path / "m"), bf16=True) == 0
    out = capsys.readouterr().out
    assert "python -m vllm.entrypoints.openai.api_server --model" in out and "curl -s" in out
    assert "/v1/chat/completions" in out
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert "quantization_config" not in config  # --bf16
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    assert len(tok) == config["vocab_size"] and tok.eos_token_id == config["eos_token_id"]
    assert tiny_model_command(str(tmp_path / "q"), as_json=True) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["quantization"] == "mxfp4"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(data["files"])


def test_the_chat_template_renders_only_ids_of_the_vocabulary(model_dir: Path) -> None:
    """tokenizer_config.json's chat template, through transformers, stays inside the vocabulary."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    text = tok.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == f"{BOS}user: Hello\n{BOS}assistant: "
    ids = tok.encode(text)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    assert ids[0] == tok.convert_tokens_to_ids(BOS) and max(ids) < vocab


def test_tiny_model_has_gpt_oss_vocabulary_so_harmony_chat_ids_fit(tmp_path: Path) -> None:
    """vLLM renders GPT-OSS chats with openai-harmony (``<|message|>`` = 200008): the ids must be rows."""
    pytest.importorskip("torch")
    from quantreg.models.gpt_oss import CHAT_VOCAB
    from quantreg.tiny.command import write_tiny_model

    out = write_tiny_model(tmp_path / "tiny")
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert config["vocab_size"] == CHAT_VOCAB == 201088
    harmony = pytest.importorskip("openai_harmony")
    encoding = harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    rendered = encoding.render_conversation_for_completion(
        harmony.Conversation.from_messages([harmony.Message.from_role_and_content(harmony.Role.USER, "Hello")]),
        harmony.Role.ASSISTANT)
    assert 200008 in rendered and max(rendered) < config["vocab_size"]
    assert max(encoding.stop_tokens_for_assistant_actions()) < config["vocab_size"]
    eos = generation["eos_token_id"]
    assert all(0 <= i < config["vocab_size"] for i in [*eos, generation["pad_token_id"], generation["bos_token_id"]])
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == config["vocab_size"]
    assert tok.token_to_id(EOS) == config["vocab_size"] - 1 in eos
