"""Planted weights: the structure real GPT-OSS-class checkpoints carry and Gaussian random weights lack.

Why: a quantisation scheme's cost depends on what it rounds. Random checkpoints
(:mod:`quantreg.tiny.checkpoint`) have unit-scale, light-tailed residual streams and weights, so a
scheme that rounds a whole token's activations with one scale (per-token int8) looks as good as one
that scales every 32-block (llama.cpp's Q8_0) -- on real models it is not. ``quantreg tiny-model
--planted`` (and ``write_tiny_gpt_oss(..., planted=True)``) writes the same seed's weights with four
things planted on top, each deterministic from the seed (its own generator, so the plain weights
underneath are bit-identical to the plain checkpoint's):

1. **Massive activations** (Sun et al., 2024, "Massive Activations in Large Language Models",
   arXiv:2402.17762): a few fixed residual-stream dimensions hold values 10^3-10^4 times the median
   on a few tokens -- the first token and delimiter tokens ("." "," "\\n") -- e.g. LLaMA2-7B's dims
   1415 and 2533 at ~2,600 and ~1,500 against a median ~0.2, constant across layers once they appear
   (they act as fixed biases; attention sinks form on those tokens). Planted through the embedding
   rows of :data:`TRIGGER_TOKENS` (``<|startoftext|>`` = V-3, which the quality bench's prompts
   begin with, and the tiny tokenizer's "." 13, "," 11, "\\n" 198): dims :data:`MASSIVE_DIMS` set to
   :data:`MASSIVE_VALUES` (+-600 / -400 against a median |x| of ~0.67 of the N(0, 1) embedding,
   ~900x / ~600x); the residual connection carries them through every layer, so the attention,
   MoE and lm_head inputs of those tokens are, after RMSNorm, two channels ~500x the rest.
2. **Outlier feature dimensions** (Dettmers et al., 2022, "LLM.int8()", arXiv:2208.07339: from
   ~6.7B parameters a handful of hidden dimensions carry large-magnitude features on most tokens):
   :data:`OUTLIER_DIMS` (6 dims) of every embedding row scaled by :data:`OUTLIER_SCALE` (20x).
3. **Heavy-tailed weight rows** (outlier weights concentrate in rows and columns: Dettmers et al.,
   2023, "SpQR", arXiv:2306.03078; single "super weights": Yu et al., 2024, arXiv:2411.07191): in every
   dense matrix (attention q/k/v/o, router, lm_head) a fraction :data:`T_ROWS` of output rows is
   redrawn Student-t with :data:`T_DOF` degrees of freedom at the same standard deviation, and (not
   in the lm_head) a fraction :data:`BIG_ROWS` scaled by :data:`BIG_SCALE`; in the MXFP4 experts (gate_up and down) a
   fraction :data:`BIG_ROWS` of rows gets its E8M0 scales raised by log2(:data:`BIG_SCALE`).
4. **The SwiGLU clamp regime**: GPT-OSS clamps gate at ``max=7`` and up to ``[-7, 7]``
   (``swiglu_limit``); random unit-scale experts almost never reach it. A fraction
   :data:`CLAMP_ROWS` of gate_up rows gets its scales raised by :data:`CLAMP_EXPONENT` (x4), so those
   rows' pre-activations have a standard deviation of ~4 and a few percent of them are clamped (the
   quality bench's exact path counts and reports the clamped fraction per layer).

The spec (:func:`planted_spec`) is written beside the weights as ``planted.json``.
Importing this module imports torch.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from quantreg.formats.mxfp4 import E8M0_BIAS

PLANTED_FILE = "planted.json"
MASSIVE_DIMS = (1415, 2533)
MASSIVE_VALUES = (600.0, -400.0)
OUTLIER_DIMS = (77, 402, 1029, 1866, 2211, 2790)
OUTLIER_SCALE = 20.0
T_ROWS = 1 / 16
T_DOF = 3.0
BIG_ROWS = 1 / 64
BIG_SCALE = 4.0
CLAMP_ROWS = 1 / 8
CLAMP_EXPONENT = 2
#: Tiny tokenizer ids (:mod:`quantreg.tiny.tokenizer`, fixed by its sorted byte alphabet) of the
#: delimiters; the first token (``<|startoftext|>``, V-3) is added per vocabulary size.
DELIMITER_TOKENS = (13, 11, 198)
_SEED_SALT = 0x51A7ED

#: Dense weight names (suffixes) that get heavy-tailed rows.
_DENSE = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "router.weight", "lm_head.weight")


def trigger_tokens(vocab: int) -> tuple[int, ...]:
    """The token ids whose embedding rows carry the massive activations: the first token, then delimiters."""
    return (vocab - 3, *(t for t in DELIMITER_TOKENS if t < vocab - 3))


def _dims(dims: tuple[int, ...], hidden: int) -> list[int]:
    """The planted dims for a hidden size (taken modulo it, distinct, so small test widths work too)."""
    out: list[int] = []
    for d in dims:
        d %= hidden
        while d in out:
            d = (d + 1) % hidden
        out.append(d)
    return out


def planted_spec(config: dict[str, Any]) -> dict[str, Any]:
    """What was planted, for ``planted.json`` and the bench's report."""
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    massive = _dims(MASSIVE_DIMS, hidden)
    return {
        "massive": {"dims": massive, "values": list(MASSIVE_VALUES), "tokens": list(trigger_tokens(vocab)),
                    "source": "Sun et al. 2024, arXiv:2402.17762"},
        "outlier_features": {"dims": [d for d in _dims(OUTLIER_DIMS, hidden) if d not in massive],
                             "scale": OUTLIER_SCALE, "source": "Dettmers et al. 2022, arXiv:2208.07339"},
        "heavy_tailed_rows": {"student_t_fraction": T_ROWS, "dof": T_DOF, "big_fraction": BIG_ROWS,
                              "big_scale": BIG_SCALE, "dense": list(_DENSE),
                              "source": "Dettmers et al. 2023, arXiv:2306.03078; Yu et al. 2024, arXiv:2411.07191"},
        "swiglu_clamp": {"rows_fraction": CLAMP_ROWS, "scale_exponent": CLAMP_EXPONENT,
                         "limit": float(config.get("swiglu_limit", 7.0))},
    }


def _pick(rows: int, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """``round(rows * fraction)`` (at least 1) distinct row indices."""
    count = max(1, round(rows * fraction))
    return torch.randperm(rows, generator=gen)[:count]


def _heavy_rows(weight: torch.Tensor, gen: torch.Generator, big_rows: bool = True) -> torch.Tensor:
    """Student-t rows and (``big_rows``) big rows in a bf16 ``[out, in]`` matrix, at the matrix's own std."""
    rows, cols = weight.shape
    std = float(weight[: min(rows, 64)].float().std())
    t_rows = _pick(rows, T_ROWS, gen)
    normal = torch.randn(len(t_rows), cols, generator=gen)
    # Student-t from the generator alone: z / sqrt(chi2 / dof), chi2 as a sum of dof squared normals
    # (dof is an integer here), scaled to unit variance (var t_nu = nu / (nu - 2)).
    dof = int(T_DOF)
    chi = sum(torch.randn(len(t_rows), cols, generator=gen) ** 2 for _ in range(dof))
    t = normal / torch.sqrt(chi / dof) / math.sqrt(T_DOF / (T_DOF - 2))
    weight[t_rows] = (t * std).to(weight.dtype)
    if not big_rows:
        return weight
    big = _pick(rows, BIG_ROWS, gen)
    weight[big] = (weight[big].float() * BIG_SCALE).to(weight.dtype)
    return weight


def _raise_scales(scales: torch.Tensor, rows: torch.Tensor, exponent: int) -> None:
    """Raise the E8M0 scales of ``rows`` (dim -2 of ``[E, N, K/32]``) by ``exponent``, in place."""
    raised = scales[:, rows].to(torch.int32) + exponent
    scales[:, rows] = raised.clamp(1, 2 * E8M0_BIAS).to(torch.uint8)


def plant_group(label: str, tensors: dict[str, torch.Tensor], config: dict[str, Any], seed: int) -> None:
    """Plant into one group of :func:`quantreg.tiny.checkpoint.gpt_oss_tensor_groups`, in place.

    Each group uses its own generator (seeded from ``seed`` and the group's label), so planting does
    not depend on the order groups are written in, and the plain draws are untouched.
    """
    gen = torch.Generator().manual_seed((seed * 1_000_003 + _SEED_SALT + sum(map(ord, label)) * 7919) % (1 << 62))
    spec = planted_spec(config)
    for name in sorted(tensors):
        value = tensors[name]
        if name == "model.embed_tokens.weight":
            outliers = spec["outlier_features"]["dims"]
            value[:, outliers] = (value[:, outliers].float() * OUTLIER_SCALE).to(value.dtype)
            for token in spec["massive"]["tokens"]:
                for dim, magnitude in zip(spec["massive"]["dims"], MASSIVE_VALUES, strict=True):
                    value[token, dim] = magnitude
        elif name.endswith(_DENSE) and value.dim() == 2:
            # no 4x rows in the lm_head: 3,000 vocabulary rows at 4x the logit scale made the output
            # distributions nearly one-hot (entropy ~0), so any rounding flipped them (bf16 alone: mean KL
            # 0.47 at 20B width, 4 layers) -- no real model is that brittle
            _heavy_rows(value, gen, big_rows=name != "lm_head.weight")
        elif name.endswith("gate_up_proj_scales"):
            rows = value.shape[1]
            _raise_scales(value, _pick(rows, CLAMP_ROWS, gen), CLAMP_EXPONENT)
            _raise_scales(value, _pick(rows, BIG_ROWS, gen), int(math.log2(BIG_SCALE)))
        elif name.endswith("down_proj_scales"):
            _raise_scales(value, _pick(value.shape[1], BIG_ROWS, gen), int(math.log2(BIG_SCALE)))
