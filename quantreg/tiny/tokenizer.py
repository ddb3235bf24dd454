"""A small working tokenizer for the tiny GPT-OSS checkpoint, so a newcomer can serve text prompts.

Why: vLLM's OpenAI server (and ``curl`` against it) needs a tokenizer in the model directory;
the tiny checkpoint (``quantreg.tiny.checkpoint``) has none, so without this only token-id
prompts with ``--skip-tokenizer-init`` work. A byte-level BPE encodes *any* text (every byte
is a token, nothing maps to ``<unk>``) and decodes back to the same text, which is what a
server smoke test needs; the model's outputs are random either way.

Layout, matching the tiny config (``vocab_size`` V, ``bos``/``pad``/``eos`` ids V-3/V-2/V-1 as
``write_tiny_gpt_oss`` writes them into ``config.json`` and ``generation_config.json``):

* ids 0..255: the 256 byte-level symbols (GPT-2's byte-to-unicode alphabet);
* then BPE merges learned deterministically from a fixed English text (:data:`CORPUS`), as
  many as fit;
* then ``<|reserved_N|>`` filler (plain entries) so the vocabulary is exactly V - 3 (the embedding
  matrix has V rows: a tokenizer larger than the model would hand it ids out of range);
* V-3 ``<|startoftext|>``, V-2 ``<|endoftext|>`` (pad), V-1 ``<|return|>`` (eos), as in GPT-OSS.

``tokenizer_config.json`` carries :data:`CHAT_TEMPLATE`, inside the vocabulary.

Only the ``tokenizers`` package (a vLLM and transformers dependency) is used; no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .. import jsonread
from ..files import read_regular
from ..writing import make_directory, replace_file

#: Special tokens, last three ids of the vocabulary, in id order (bos, pad, eos).
BOS, PAD, EOS = "<|startoftext|>", "<|endoftext|>", "<|return|>"
SPECIALS = (BOS, PAD, EOS)
BYTE_SYMBOLS = 256
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

#: The fixed text the merges are learned from; changing it changes every token id.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a few
experts; the router picks the top k of them and mixes their outputs with softmax weights.
Quantization stores the expert weights in four bits with one shared scale per block of thirty
two values, and the method that runs them is chosen by a registry from a table of rules.
Hello, world! What is the capital of France? Paris is the capital of France. Once upon a time
there was a small model that answered every question with random words, and that was fine,
because the test only wanted to know that the server was up and the words came back.
The operator writes a table, the registry reads it, and vLLM builds the layers with the method
the table names for the quant format, the model type and the device.
"""


#: A chat template whose text is only special tokens of this vocabulary and plain (byte-level) text,
#: so every id it renders is in the vocabulary; for ``transformers``' ``apply_chat_template`` and any
#: server that honours ``tokenizer_config.json``. (vLLM renders GPT-OSS chats with openai-harmony
#: instead, whatever the template says: that is why :data:`quantreg.models.gpt_oss.CHAT_VOCAB`.)
CHAT_TEMPLATE = (
    "{% for message in messages %}" + BOS + "{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}" + BOS + "assistant: {% endif %}"
)


def _learned(target: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE vocabulary (at most ``target`` entries) and merges learned from :data:`CORPUS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=target, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator([CORPUS], trainer=trainer)
    state = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    return dict(state["vocab"]), [(a, b) for a, b in merges]


def build_tokenizer(vocab_size: int) -> Any:
    """A ``tokenizers.Tokenizer`` with exactly ``vocab_size`` ids (see the module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if vocab_size < BYTE_SYMBOLS + len(SPECIALS):
        raise ValueError(f"vocab_size {vocab_size} leaves no room for {BYTE_SYMBOLS} byte symbols "
                         f"and {len(SPECIALS)} special tokens")
    body = vocab_size - len(SPECIALS)
    learned, merges = _learned(body)
    # Byte symbols first (ids 0..255, in alphabet order), then merged tokens by their learned id.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {s: i for i, s in enumerate(alphabet)}
    for token, _ in sorted(learned.items(), key=lambda kv: kv[1]):
        if token not in vocab and len(vocab) < body:
            vocab[token] = len(vocab)
    merges = [(a, b) for a, b in merges if a in vocab and b in vocab and a + b in vocab]
    reserved = 0
    while len(vocab) < body:
        vocab[f"<|reserved_{reserved}|>"] = len(vocab)
        reserved += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    # The reserved fillers stay plain vocabulary entries (no merge reaches them; they decode to
    # their own text): as added tokens, the ~200,000 of GPT-OSS's vocabulary size made
    # transformers' tokenizer load take 35 s.
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise AssertionError(f"built {tok.get_vocab_size(with_added_tokens=True)} ids, wanted {vocab_size}")
    return tok


def write_tokenizer(directory: str | Path, vocab_size: int | None = None, *, model_max_length: int = 4096) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into ``directory``.

    ``vocab_size`` defaults to the ``vocab_size`` of ``directory/config.json`` (the checkpoint
    the tokenizer is for). Loadable by ``transformers.AutoTokenizer`` and by vLLM.
    """
    out = Path(directory)
    if vocab_size is None:
        config = jsonread.loads(read_regular(out / "config.json", 1 << 20, expected="a JSON file"))
        vocab_size = int(config["vocab_size"])
    make_directory(out)
    tok = build_tokenizer(vocab_size)
    replace_file(out / "tokenizer.json", tok.to_str(pretty=True))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": {
            str(i): {"content": s, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                     "single_word": False}
            for s, i in ids.items()
        },
    }
    replace_file(out / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    replace_file(out / "special_tokens_map.json",
                 json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n")
    return out
