"""One vLLM-CPU engine for :mod:`bench.quality_bench`: full-vocabulary logits of every prompt position.

Usage: ``python -m bench.quality_vllm_child MODEL_DIR PROMPTS.json OUT_DIR TAG [eager|default] [MAX_BATCHED]``,
environment from the parent (``QUANTREG_CONFIG`` for a table, ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` so
the model runs in this process). Writes ``OUT_DIR/TAG-<i>.npy`` (fp32 logits ``[L-1, V]``: positions
0..L-2 of prompt i) and prints one ``QRB {json}`` line: what vLLM built, the check below, peak RSS.

How the logits are taken: vLLM returns at most a few log-probabilities per position, so a forward
hook on the model's ``logits_processor`` (what ``compute_logits`` calls: the lm_head's quant method,
then vLLM's logit post-processing) records its output while one ``generate`` per prompt asks for
``prompt_logprobs=1``; vLLM then computes logits for every prompt position (one call, or one per
chunk under ``MAX_BATCHED`` < L), plus one row for the sampled token (computed first). The check: at every position,
the token vLLM returns as rank 1 must be the captured row's argmax (or tie with it) and its returned
log-probability must equal ``log_softmax`` of the captured row there (within 2e-3): so the captured
rows are the logits vLLM itself turned into its answer, in order.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

PREFIX = "QRB "
CAPTURED: list[Any] = []


def install(model: Any) -> int:
    """(In this process: the worker.) A forward hook on every logits processor; returns how many."""
    count = 0
    for name, module in model.named_modules():
        if name.endswith("logits_processor"):
            module.register_forward_hook(lambda _m, _a, out: CAPTURED.append(out.detach().float().clone()))
            count += 1
    return count


def main() -> None:
    model_dir, prompts_path, out_dir, tag = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    eager = (sys.argv[5] if len(sys.argv) > 5 else "eager") == "eager"
    prompts: list[list[int]] = [p["ids"] for p in json.loads(prompts_path.read_text())["prompts"]]
    longest = max(len(p) for p in prompts)
    max_batched = int(sys.argv[6]) if len(sys.argv) > 6 and int(sys.argv[6]) > 0 else max(longest, 2048)
    import numpy as np
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=model_dir, seed=0, skip_tokenizer_init=True, enforce_eager=eager, dtype="bfloat16",
              max_model_len=longest + 8, kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False,
              max_num_batched_tokens=max_batched, enable_chunked_prefill=max_batched < longest,
              max_logprobs=1)
    engine_s = time.perf_counter() - t0
    hooks = llm.apply_model(install)[0]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, seed=0, detokenize=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    check = {"positions": 0, "rank1_is_argmax": 0, "rank1_tied": 0, "max_abs_logprob_diff": 0.0}
    calls = []
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        CAPTURED.clear()
        output = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        rows = [c for c in CAPTURED]
        calls.append([int(r.shape[0]) for r in rows])
        # vLLM 0.32 computes the sampled token's single row first, then the prompt positions (one call,
        # or one per chunk of >= 2 rows under MAX_BATCHED), in order: the multi-row calls are the prompt's
        logits = torch.cat([r for r in rows if r.shape[0] > 1])
        if logits.shape[0] != len(ids) - 1:
            raise SystemExit(f"prompt {i}: captured {[r.shape[0] for r in rows]} rows, expected {len(ids) - 1} "
                             "prompt positions plus one sampled row")
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        returned = output.prompt_logprobs or []
        for pos in range(1, len(ids)):
            entry = returned[pos]
            if entry is None:
                continue
            rank1 = [tok for tok, lp in entry.items() if lp.rank == 1]
            if not rank1:
                continue
            tok = rank1[0]
            row = logprobs[pos - 1]
            check["positions"] += 1
            best = int(row.argmax())
            if best == tok:
                check["rank1_is_argmax"] += 1
            elif float(row[best] - row[tok]) <= 1e-6:
                check["rank1_tied"] += 1
            diff = abs(float(entry[tok].logprob) - float(row[tok]))
            check["max_abs_logprob_diff"] = max(check["max_abs_logprob_diff"], diff)
        np.save(out_dir / f"{tag}-{i}.npy", logits.numpy().astype(np.float32))
    seconds = time.perf_counter() - t0
    from quantreg.testing.vllm_probes import inspect_moe_layers

    layers = [layer for worker in llm.apply_model(inspect_moe_layers) for layer in worker["layers"]]

    def dense_methods(model: Any) -> dict[str, str]:
        found: dict[str, str] = {}
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if method is not None and not name.endswith("experts"):
                kind = name.split(".")[-1]
                found.setdefault(kind, type(method).__name__)
        return found

    ok = (check["positions"] > 0 and check["rank1_is_argmax"] + check["rank1_tied"] == check["positions"]
          and check["max_abs_logprob_diff"] <= 2e-3)
    print(PREFIX + json.dumps({
        "engine_s": engine_s, "seconds": seconds, "hooks": hooks, "calls": calls, "check": {**check, "ok": ok},
        "moe_methods": sorted({layer["quant_method"] for layer in layers}),
        "experts_cls": sorted({str(layer["experts_cls"]) for layer in layers}),
        "dense_methods": llm.apply_model(dense_methods)[0], "mode": "eager" if eager else "default",
        "max_num_batched_tokens": max_batched, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}), flush=True)
    if not ok:
        raise SystemExit(f"captured logits disagree with vLLM's own prompt logprobs: {check}")


if __name__ == "__main__":
    main()
