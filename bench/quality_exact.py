"""The quality bench's exact path: GPT-OSS's forward written from the model's definition, in fp32 (or float64).

    python -m bench.quality_exact MODEL_DIR PROMPTS.json OUT_DIR [--dtype float32|float64] [--tokens N]

Why a forward of its own: the bench compares every engine's output distribution with one defined
once, not with another engine's. It computes what vLLM's ``gpt_oss.py`` computes, from the checkpoint's
tensors, with no rounding but the dtype's:

* embedding row; per layer ``r += attn(rms(r)); r += moe(rms(r))``; ``logits = lm_head(rms(r))``
  (RMSNorm eps 1e-5, weight after the normalisation);
* attention: q/k/v with biases, 64 query heads over 8 KV heads, rotary NeoX-style with YaRN as vLLM
  applies it (``YaRNScalingRotaryEmbedding``: factor, beta_fast/beta_slow, original context,
  ``truncate`` from config.json, cos/sin times mscale = 0.1 ln(factor) + 1), scale 1/sqrt(head_dim),
  causal, a sliding window of ``sliding_window`` keys (``i - j < W``) on even layers, full on odd
  ones, and the per-head sink logit in the softmax's denominator only; o_proj with bias;
* MoE: router with bias, top-k, softmax over the k logits; per expert gate/up interleaved rows
  (gate 0::2, up 1::2) with bias, ``gate.clamp(max=limit)``, ``up.clamp(-limit, limit)``,
  ``(up + 1) * gate * sigmoid(1.702 gate)``, down with bias, weighted sum -- experts dequantised
  exactly from MXFP4 (every E2M1 x 2^k value is an fp32), one expert at a time, only the routed ones.

Memory: layers are streamed (one layer's tensors at a time from the safetensors shards, experts
dequantised per expert), the lm_head in vocabulary chunks; the whole prompt set's hidden states are
in memory (tokens x hidden). Writes ``OUT_DIR/exact-<i>.npy`` (fp32 log-probabilities, positions
0..L-2 of prompt i: the distributions of tokens 1..L-1) and ``OUT_DIR/exact.json`` (per-layer
statistics: the residual stream's max |x| over its median, the massive dims, the fraction of
SwiGLU inputs at the clamp). ``--tokens N`` truncates every prompt to N tokens (the float64 check).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cli_args import Parser, whole
from quantreg.formats.mxfp4 import dequantize_mxfp4

ALPHA = 1.702
VOCAB_CHUNK = 16384


class _Store:
    """Where vLLM holds a bf16 tensor between two ops, ``--dtype bf16store`` rounds the fp32 value to bf16
    (projections' outputs, norms' outputs, residual sums, router logits, expert outputs, logits); inside
    an op (accumulation, softmax, the norm's mean square) it stays fp32. Identity otherwise."""

    on = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).to(x.dtype) if self.on else x


R = _Store()


class Weights:
    """Tensors by name from a (sharded) safetensors checkpoint, read one at a time."""

    def __init__(self, model: Path) -> None:
        from safetensors import safe_open

        index = model / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            weight_map = {}
        self._files: dict[str, Any] = {}
        shards = sorted(set(weight_map.values())) or ["model.safetensors"]
        for shard in shards:
            handle = safe_open(str(model / shard), framework="pt")
            for name in handle.keys():
                self._files[name] = handle

    def __call__(self, name: str) -> torch.Tensor:
        return self._files[name].get_tensor(name)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return R(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x.dtype))


def yarn_cos_sin(config: dict[str, Any], positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[positions, head_dim/2]`` times mscale, as vLLM's YaRN rotary computes them (in float64 here)."""
    rope = config["rope_scaling"]
    dim, base = int(config["head_dim"]), float(config["rope_theta"])
    factor, original = float(rope["factor"]), int(rope["original_max_position_embeddings"])
    beta_fast, beta_slow = float(rope["beta_fast"]), float(rope["beta_slow"])
    truncate = bool(rope.get("truncate", True))

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    mask = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - mask) + (1.0 / pos_freqs) * mask
    mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    freqs = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return (freqs.cos() * mscale).to(dtype), (freqs.sin() * mscale).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotary on ``[L, heads, head_dim]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def attention(h: torch.Tensor, w: Any, p: str, config: dict[str, Any], layer: int,
              cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dt = h.dtype
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    hd = int(config["head_dim"])
    length = h.shape[0]
    q = R(h @ w(p + "q_proj.weight").to(dt).T + w(p + "q_proj.bias").to(dt)).view(length, heads, hd)
    k = R(h @ w(p + "k_proj.weight").to(dt).T + w(p + "k_proj.bias").to(dt)).view(length, kv_heads, hd)
    v = R(h @ w(p + "v_proj.weight").to(dt).T + w(p + "v_proj.bias").to(dt)).view(length, kv_heads, hd)
    q, k = R(rotate(q, cos[:length], sin[:length])), R(rotate(k, cos[:length], sin[:length]))
    group = heads // kv_heads
    q = q.view(length, kv_heads, group, hd).permute(1, 2, 0, 3)  # [kv, g, L, hd]
    k, v = k.permute(1, 0, 2), v.permute(1, 0, 2)  # [kv, L, hd]
    scores = torch.einsum("kgld,kmd->kglm", q, k) * hd ** -0.5
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    allowed = j <= i
    if layer % 2 == 0:  # sliding on even layers (vLLM: config.sliding_window if layer_idx % 2 == 0)
        allowed &= (i - j) < int(config["sliding_window"])
    scores = scores.masked_fill(~allowed, float("-inf"))
    sinks = w(p + "sinks").to(dt).view(kv_heads, group, 1, 1).expand(kv_heads, group, length, 1)
    full = torch.cat((scores, sinks), dim=-1)
    probs = torch.softmax(full, dim=-1)[..., :length]
    out = R(torch.einsum("kglm,kmd->lkgd", probs, v).reshape(length, heads * hd))
    return R(out @ w(p + "o_proj.weight").to(dt).T + w(p + "o_proj.bias").to(dt))


def moe(x: torch.Tensor, w: Any, p: str, config: dict[str, Any], stats: dict[str, float]) -> torch.Tensor:
    dt = x.dtype
    top_k, limit = int(config["num_experts_per_tok"]), float(config["swiglu_limit"])
    logits = R(x @ w(p + "router.weight").to(dt).T + w(p + "router.bias").to(dt))
    values, ids = torch.topk(logits, top_k, dim=-1)
    weights = torch.softmax(values, dim=-1)
    e = p + "experts."
    gu_blocks, gu_scales = w(e + "gate_up_proj_blocks"), w(e + "gate_up_proj_scales")
    gu_bias = w(e + "gate_up_proj_bias")
    dn_blocks, dn_scales, dn_bias = w(e + "down_proj_blocks"), w(e + "down_proj_scales"), w(e + "down_proj_bias")
    out = torch.zeros_like(x)
    for expert in range(gu_blocks.shape[0]):
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        w13 = dequantize_mxfp4(gu_blocks[expert], gu_scales[expert], torch.float32).to(dt)  # exact
        h = x[tokens] @ w13.T + gu_bias[expert].to(dt)
        del w13
        gate, up = h[:, 0::2], h[:, 1::2]
        stats["gate_clamped"] += float((gate > limit).sum())
        stats["up_clamped"] += float((up.abs() > limit).sum())
        stats["values"] += float(gate.numel())
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        act = (up + 1) * gate * torch.sigmoid(ALPHA * gate)
        w2 = dequantize_mxfp4(dn_blocks[expert], dn_scales[expert], torch.float32).to(dt)
        y = act @ w2.T + dn_bias[expert].to(dt)
        del w2
        out.index_add_(0, tokens, y * weights[tokens, slots].unsqueeze(1))
    return R(out)


def residual_stats(rs: list[torch.Tensor]) -> dict[str, Any]:
    """Max |x| over the median |x| of the residual stream and where the max sits."""
    r = torch.cat(rs).abs().float()
    flat_max = int(r.argmax())
    token, dim = divmod(flat_max, r.shape[1])
    top_dims = torch.topk(r.max(dim=0).values, 4).indices.tolist()
    median = float(r.median())
    return {"max": float(r.max()), "median": median, "max_over_median": float(r.max()) / max(median, 1e-30),
            "max_token": token, "max_dim": dim, "top_dims": top_dims}


def forward(model: Path, prompts: list[list[int]], dtype: torch.dtype, out_dir: Path, tag: str) -> dict[str, Any]:
    config = json.loads((model / "config.json").read_text())
    w = Weights(model)
    eps = float(config["rms_norm_eps"])
    embed = w("model.embed_tokens.weight")
    rs = [embed[torch.tensor(ids)].to(dtype) for ids in prompts]
    del embed
    cos, sin = yarn_cos_sin(config, max(len(ids) for ids in prompts), dtype)
    layers: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for layer in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{layer}."
        for i, r in enumerate(rs):
            h = rms_norm(r, w(p + "input_layernorm.weight"), eps)
            rs[i] = R(r + attention(h, w, p + "self_attn.", config, layer, cos, sin))
        sizes = [r.shape[0] for r in rs]
        r_all = torch.cat(rs)
        stats = {"gate_clamped": 0.0, "up_clamped": 0.0, "values": 0.0}
        r_all = R(r_all + moe(rms_norm(r_all, w(p + "post_attention_layernorm.weight"), eps), w, p + "mlp.", config,
                              stats))
        rs = list(torch.split(r_all, sizes))
        n = max(stats["values"], 1.0)
        layers.append({"layer": layer, "gate_clamped_fraction": stats["gate_clamped"] / n,
                       "up_clamped_fraction": stats["up_clamped"] / n, "residual": residual_stats(rs)})
        print(f"[exact {tag}] layer {layer}: {time.perf_counter() - t0:.1f} s, clamp gate "
              f"{layers[-1]['gate_clamped_fraction']:.4f}, residual max/median "
              f"{layers[-1]['residual']['max_over_median']:.0f}", file=sys.stderr, flush=True)
    norm = w("model.norm.weight")
    head = w("lm_head.weight")
    out_dir.mkdir(parents=True, exist_ok=True)
    for i, r in enumerate(rs):
        x = rms_norm(r[:-1], norm, eps)
        logits = torch.empty(x.shape[0], head.shape[0], dtype=dtype)
        for lo in range(0, head.shape[0], VOCAB_CHUNK):
            logits[:, lo:lo + VOCAB_CHUNK] = x @ head[lo:lo + VOCAB_CHUNK].to(dtype).T
        logprobs = torch.log_softmax(R(logits) if dtype != torch.bfloat16 else logits.float(), dim=-1)
        np.save(out_dir / f"{tag}-{i}.npy", logprobs.numpy())
        del logits, logprobs
    return {"dtype": str(dtype).replace("torch.", ""), "seconds": time.perf_counter() - t0, "layers": layers,
            "positions": sum(len(ids) - 1 for ids in prompts)}


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("prompts", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "bf16store"), default="float32",
                        help="float64: the check of the fp32 path; bf16store: fp32 ops with every tensor vLLM "
                             "holds in bf16 rounded to bf16 (the scale of 'bf16 rounding' for the bound); "
                             "bfloat16: every op in torch's bf16")
    parser.add_argument("--tokens", type=whole(0, 65536), default=0, help="truncate every prompt to this many tokens")
    parser.add_argument("--only", type=whole(0, 1 << 20), default=None, help="only this prompt (index)")
    parser.add_argument("--threads", type=whole(0, 4096), default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts: list[list[int]] = [p["ids"] for p in json.loads(args.prompts.read_text())["prompts"]]
    if args.only is not None:
        prompts = [prompts[args.only]]
    if args.tokens:
        prompts = [ids[: args.tokens] for ids in prompts]
    dtype = {"float64": torch.float64, "bfloat16": torch.bfloat16}.get(args.dtype, torch.float32)
    R.on = args.dtype == "bf16store"
    tag = {"float32": "exact", "bf16store": "bf16ref", "bfloat16": "bf16ops"}.get(args.dtype, "check")
    if args.tokens or args.only is not None:
        tag = f"check-{args.dtype}"
    with torch.no_grad():  # not inference_mode: dequantize_mxfp4's threaded path writes into its output
        report = forward(args.model, prompts, dtype, args.out_dir, tag)
    (args.out_dir / f"{tag}.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
