"""The quality bench's fixed prompt sets and its metrics (KL divergence against the exact path, top-1 agreement).

Prompt sets (:func:`prompt_sets`), all deterministic, every prompt starting with ``<|startoftext|>``
(V-3: the first token, where real models hold their massive activations; the planted checkpoint plants
them on it and on "." "," "\\n"):

* ``text``: English text (this project's README prose, fixed here) through the checkpoint's own
  tokenizer (:mod:`quantreg.tiny.tokenizer`): many delimiters, real BPE merges;
* ``random``: uniform random ids in [300, V-3) (seeded): almost no delimiter;
* ``delimited``: random ids with a delimiter ("." "," or "\\n") every 4-12 tokens: many massive-activation
  tokens in the context of every position.

Metrics (:func:`kl_metrics`), per position over the full vocabulary, as llama.cpp's
``llama-perplexity --kl-divergence`` reports them: KL(exact || engine) = sum p_exact (log p_exact - log
p_engine) in float64; its mean, median, 99th and 99.9th percentiles and maximum over all positions;
"same top" = the share of positions where the engine's most likely token is the exact path's.
Per prompt set the mean KL and same-top, so the spread across sets shows.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np

SETS = ("text", "random", "delimited")
DELIMITERS = (13, 11, 198)

TEXT = """\
quantreg is a registry of MoE quantization methods for vLLM. A table of rules maps a key (the model's
quantization format, its model type, the device, the layer kind, the number of tokens in a forward) to
a method, and the registry picks the first method that can run on this host. The rules are plain YAML,
checked when they load: a mistake names its file, line and key, and what was expected. Plugins ship
methods and tables of their own; a user's table comes first. On a CPU without AMX, vLLM has no kernel
for GPT-OSS's MXFP4 experts, so the registry routes them to the plugin's compiled kernel, which reads
each expert's packed bytes once, decodes the four-bit codes through a table, and multiplies them with
the activations rounded to eight bits per block of thirty-two values. Dense layers stay in bf16 unless
a table opts them in to int8. How much does that rounding cost? Speed is measured in one run, side by
side, against llama.cpp; quality is measured here, on the same weights, against an exact forward.
The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a few experts,
and the router picks the top four of them and mixes their outputs with softmax weights.
"""


def _text_ids(vocab: int) -> list[int]:
    from quantreg.tiny.tokenizer import build_tokenizer

    ids: list[int] = build_tokenizer(vocab).encode(TEXT).ids
    return ids


def prompt_sets(vocab: int, per_set: int, length: int, seed: int = 0) -> list[dict[str, Any]]:
    """``per_set`` prompts of ``length`` tokens for each of :data:`SETS`, as ``{"set", "ids"}`` dicts."""
    rng = random.Random(seed)
    bos = vocab - 3
    text = _text_ids(vocab)
    prompts: list[dict[str, Any]] = []
    for name in SETS:
        for k in range(per_set):
            if name == "text":
                start = (k * 97) % len(text)
                body = [text[(start + i) % len(text)] for i in range(length - 1)]
            elif name == "random":
                body = [rng.randrange(300, vocab - 3) for _ in range(length - 1)]
            else:
                body = []
                while len(body) < length - 1:
                    body += [rng.randrange(300, vocab - 3) for _ in range(rng.randrange(4, 13))]
                    body.append(rng.choice(DELIMITERS))
                body = body[: length - 1]
            prompts.append({"set": name, "ids": [bos, *body]})
    return prompts


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def compare(exact: Path, engine: Path, chunk: int = 64,
            engine_is_logprobs: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per position: KL(exact || engine) and whether the top tokens agree, for one prompt's files."""
    p_all = np.load(exact, mmap_mode="r")
    q_all = np.load(engine, mmap_mode="r")
    if p_all.shape != q_all.shape:
        raise ValueError(f"{engine.name}: shape {q_all.shape}, the exact path's {p_all.shape}")
    kls, same = [], []
    for lo in range(0, p_all.shape[0], chunk):
        lp = np.asarray(p_all[lo:lo + chunk], dtype=np.float64)
        lq = np.asarray(q_all[lo:lo + chunk], dtype=np.float64)
        lq = lq if engine_is_logprobs else _log_softmax(lq)
        lq = np.where(np.isfinite(lq), lq, -1e30)
        kls.append(np.maximum((np.exp(lp) * (lp - lq)).sum(axis=-1), 0.0))
        same.append(lp.argmax(axis=-1) == lq.argmax(axis=-1))
    return np.concatenate(kls), np.concatenate(same)


def kl_metrics(kl: np.ndarray, same: np.ndarray) -> dict[str, float]:
    """llama.cpp's summary of per-position KL divergences and same-top flags."""
    return {"positions": int(kl.size), "kl_mean": float(kl.mean()), "kl_median": float(np.median(kl)),
            "kl_p99": float(np.percentile(kl, 99)), "kl_p999": float(np.percentile(kl, 99.9)),
            "kl_max": float(kl.max()), "same_top": float(same.mean())}


def engine_metrics(work: Path, tag: str, prompts: list[dict[str, Any]], exact_tag: str = "exact",
                   engine_is_logprobs: bool = False) -> dict[str, Any]:
    """All of one engine's metrics against the exact path: pooled, and per prompt set."""
    per_set: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for i, prompt in enumerate(prompts):
        kl, same = compare(work / f"{exact_tag}-{i}.npy", work / f"{tag}-{i}.npy",
                           engine_is_logprobs=engine_is_logprobs)
        kls, sames = per_set.setdefault(prompt["set"], ([], []))
        kls.append(kl)
        sames.append(same)
    sets = {name: kl_metrics(np.concatenate(k), np.concatenate(s)) for name, (k, s) in per_set.items()}
    pooled = kl_metrics(np.concatenate([x for k, _ in per_set.values() for x in k]),
                        np.concatenate([x for _, s in per_set.values() for x in s]))
    means = [m["kl_mean"] for m in sets.values()]
    tops = [m["same_top"] for m in sets.values()]
    return {**pooled, "sets": sets, "spread": {"kl_mean_min": min(means), "kl_mean_max": max(means),
                                               "same_top_min": min(tops), "same_top_max": max(tops)}}
