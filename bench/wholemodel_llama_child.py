"""One llama.cpp engine (llama-cpp-python) for :mod:`bench.wholemodel_bench`, one measurement at a time.

Usage, with the llama environment's Python (``bench/llama_setup.sh``; this file imports neither
quantreg nor torch): ``python bench/wholemodel_llama_child.py MODEL.gguf THREADS N_CTX``. It loads
the GGUF, runs one warm-up, prints ``READY`` with its start-up split and the GGUF's tensor sizes
(from which the parent derives the bytes read per token), then obeys one JSON command per stdin
line, replying with single ``QRB ``-prefixed lines, like :mod:`bench.wholemodel_vllm_child`:

* ``{"op": "generate", "prompt": [ids], "max_tokens": N}``: prompt evaluation then greedy tokens
  (llama.cpp's own sampler chain, top-k 1), the KV cache cleared first so nothing is reused;
* ``{"op": "finish"}``: peak RSS, then exit.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any

PREFIX = "QRB "
T_START = time.perf_counter()


def reply(value: dict[str, Any]) -> None:
    print(PREFIX + json.dumps(value), flush=True)


def gguf_tensors(path: str) -> dict[str, Any]:
    """Every tensor's name, ggml type and bytes in the file (gguf's reader maps the file; no copy)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {t.name: {"type": t.tensor_type.name, "bytes": int(t.n_bytes)} for t in reader.tensors}


def main() -> None:
    path, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tensors = gguf_tensors(path)
    t0 = time.perf_counter()
    import llama_cpp

    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads, seed=0, verbose=False)
    load_s = time.perf_counter() - t0

    def generate(prompt: list[int], max_tokens: int) -> list[int]:
        llm.reset()  # n_tokens = 0: generate() finds no prefix to reuse and clears the KV cache
        out: list[int] = []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if len(out) >= max_tokens:
                break
        return out

    t0 = time.perf_counter()
    generate(list(range(100, 116)), 8)
    warmup_s = time.perf_counter() - t0
    reply({"ready": True, "import_s": import_s, "load_s": load_s, "warmup_s": warmup_s,
           "since_exec_s": time.perf_counter() - T_START, "tensors": tensors,
           "llama_cpp": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode()})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "finish":
            break
        if command["op"] != "generate":
            reply({"error": f"unknown op {command['op']!r}"})
            continue
        t0 = time.perf_counter()
        tokens = generate([int(t) for t in command["prompt"]], int(command["max_tokens"]))
        reply({"seconds": time.perf_counter() - t0, "tokens": tokens})
    reply({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})


if __name__ == "__main__":
    main()
