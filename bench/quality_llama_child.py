"""One llama.cpp engine for :mod:`bench.quality_bench`: full-vocabulary logits of every prompt position.

Usage, with the llama environment's Python (``bench/llama_setup.sh``; imports neither quantreg nor
torch): ``python bench/quality_llama_child.py MODEL.gguf PROMPTS.json OUT_DIR TAG THREADS``.
llama-cpp-python with ``logits_all=True`` keeps the logits of every evaluated position
(``Llama.scores``); each prompt is evaluated from an empty KV cache in one ``eval`` (n_batch =
n_ubatch = the longest prompt, so one graph per prompt, as vLLM's one prefill). Writes
``OUT_DIR/TAG-<i>.npy`` (fp32 ``[L-1, V]``, positions 0..L-2) and prints one ``QRB {json}`` line.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def main() -> None:
    path, prompts_path, out_dir, tag, threads = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], int(
        sys.argv[5])
    import llama_cpp
    import numpy as np

    prompts: list[list[int]] = [p["ids"] for p in json.loads(prompts_path.read_text())["prompts"]]
    longest = max(len(p) for p in prompts)
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=longest + 8, n_batch=longest, n_ubatch=longest, n_threads=threads,
                          n_threads_batch=threads, seed=0, logits_all=True, verbose=False)
    load_s = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        llm.reset()  # n_tokens = 0 and the KV memory cleared (llama-cpp-python 0.3.36's reset)
        llm.eval(ids)
        scores = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float32)
        if scores.shape != (len(ids) - 1, llm.n_vocab()):
            raise SystemExit(f"prompt {i}: scores {scores.shape}, expected {(len(ids) - 1, llm.n_vocab())}")
        np.save(out_dir / f"{tag}-{i}.npy", scores)
    print("QRB " + json.dumps({"load_s": load_s, "seconds": time.perf_counter() - t0,
                               "llama_cpp": llama_cpp.__version__,
                               "n_vocab": llm.n_vocab(), "system_info": llama_cpp.llama_print_system_info().decode(),
                               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}),
          flush=True)


if __name__ == "__main__":
    main()
