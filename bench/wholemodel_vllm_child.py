"""One vLLM-CPU engine for :mod:`bench.wholemodel_bench`, driven one measurement at a time.

Usage: ``python -m bench.wholemodel_vllm_child MODEL_DIR [MAX_LEN [default|eager]]``: vLLM's default
mode (the model compiled, traced once, as ``vllm serve`` runs it; ``engine_s`` then includes the
compile) or eager (``enforce_eager``). The split's hooks see only modules run outside a compiled graph,
so in the default mode it measures the lm_head and what is outside the model; the parent reports it
for eager variants. Environment from the parent: the
thread binding, ``QUANTREG_CONFIG`` for a table variant, ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` so the
model runs in this process and its modules can be timed here). It builds the engine, runs one
warm-up, prints ``READY`` with its start-up split, then obeys one JSON command per stdin line:

* ``{"op": "generate", "prompt": [ids], "max_tokens": N}``: one timed greedy generate; replies its
  wall seconds and the generated ids;
* ``{"op": "split", "prompt": [ids], "max_tokens": N}``: the same generate with timing hooks on the
  model's modules (``"prompts": [[ids], ...]`` instead: that many sequences in one generate, so
  every decode step serves all of them at once, as a server under that many clients does): per
  decode step (mean over the steps after the prompt's), the seconds in the
  MoE blocks (router + experts), in the rest of the model's forward (attention, dense linears,
  norms, embedding), in the lm_head (vLLM's logits processor) and outside the model (scheduler,
  sampling, Python) -- see ``_Clock.decode_split``;
* ``{"op": "finish"}``: peak RSS, what vLLM built for the MoE layers and the ISA it ran at (torch's
  CPU capability and the ISA-forcing variables it was given); then the child exits.

Replies are single lines prefixed with ``QRB `` (vLLM logs to the same streams). Why in-process
hooks rather than torch.profiler: the profiler's per-op records at 24 layers x 128 steps cost more
than the step itself; four ``perf_counter`` pairs per layer cost microseconds against a step of
tens of milliseconds (the split is taken in a separate call from the timed ones all the same).
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import sys
import time
from typing import Any

PREFIX = "QRB "
T_START = time.perf_counter()


def reply(value: dict[str, Any]) -> None:
    print(PREFIX + json.dumps(value), flush=True)


class _Clock:
    """Records the (start, end) wall times of every call of the hooked modules, by category."""

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[float, float]]] = {}
        self.enabled = False

    def hook(self, module: Any, category: str) -> list[Any]:
        started: list[float] = []

        def pre(_module: Any, _args: Any) -> None:
            if self.enabled:
                started.append(time.perf_counter())

        def post(_module: Any, _args: Any, _out: Any) -> None:
            if self.enabled and started:
                self.spans.setdefault(category, []).append((started.pop(), time.perf_counter()))

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def decode_split(self) -> dict[str, Any]:
        """Mean seconds per decode step, from the recorded spans of one generate: step ``i`` runs
        from the start of model forward ``i`` to the start of forward ``i + 1``; inside it the
        forward (MoE blocks within it, the rest = attention + dense), the lm_head (logits
        processor) after it, and the rest of the period (scheduler, sampling, Python). Forward 0 is
        the prompt's (prefill): skipped; the last forward has no next start: skipped."""
        forwards = sorted(self.spans.get("model", []))
        moe = self.spans.get("moe", [])
        heads = self.spans.get("lm_head", [])
        steps = []
        for (start, end), (next_start, _) in itertools.pairwise(forwards[1:]):
            inside = sum(e - s for s, e in moe if start <= s and e <= end)
            head = sum(e - s for s, e in heads if end <= s and e <= next_start)
            moe_calls = sum(1 for s, e in moe if start <= s and e <= end)
            steps.append((next_start - start, end - start, inside, head, moe_calls))
        if not steps:
            return {"steps": 0}
        n = len(steps)
        period, forward, inside, head = (sum(x[i] for x in steps) / n for i in range(4))
        return {"steps": n, "step_s": period, "moe_s": inside, "attention_dense_s": forward - inside,
                "lm_head_s": head, "rest_s": period - forward - head,
                "moe_calls_per_step": sum(x[4] for x in steps) / n,
                "lm_head_calls": len(heads), "forwards": len(forwards)}


CLOCK = _Clock()


def held_bytes(model: Any) -> dict[str, float]:
    """Bytes of weights the engine holds, by what a decode step reads of them: ``experts`` (all
    experts of every MoE layer: a token reads top_k / E of them), ``embedding`` (a token reads one
    row), ``dense`` (everything else, read whole every step: attention, router, norms, lm_head).
    Counted from the live modules (parameters, buffers, and a quantreg method's
    ``resident_bytes()`` for weights a method keeps outside parameters -- plugin #2's repacked
    experts, a dense int8 method's prepacked copy), so a table that changes what is held (a dense
    int8 rule) changes the count."""
    from quantreg.testing.vllm_probes import moe_layers

    def size(module: Any) -> int:
        tensors = list(module.parameters(recurse=True)) + list(module.buffers(recurse=True))
        return sum(t.numel() * t.element_size() for t in tensors)

    experts = 0
    seen: set[int] = set()
    moe_modules = {id(module) for _, module in moe_layers(model)}
    for _, module in moe_layers(model):
        experts += size(module)
        seen.update(id(t) for t in list(module.parameters()) + list(module.buffers()))
        resident = getattr(module.quant_method, "resident_bytes", None)
        if callable(resident):
            experts += int(resident())
    embedding = 0
    dense = 0
    for module in model.modules():  # dense methods that keep weights outside parameters
        resident = getattr(getattr(module, "quant_method", None), "resident_bytes", None)
        if callable(resident) and id(module) not in moe_modules:
            dense += int(resident())
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if id(tensor) in seen:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if "embed" in name:  # vLLM's GPT-OSS names it model.embedding
            embedding += nbytes
        else:
            dense += nbytes
    return {"experts": float(experts), "embedding": float(embedding), "dense": float(dense)}


def install_hooks(model: Any) -> dict[str, Any]:
    """(Runs in the worker, here this process.) Hooks on the whole model, each MoE block and the
    logits processor; returns what was hooked so the parent can check the split is complete, and
    :func:`held_bytes`."""
    moe = [name for name, module in model.named_modules() if name.endswith(".mlp")]
    held = held_bytes(model)
    handles = CLOCK.hook(model, "model")
    for name, module in model.named_modules():
        if name.endswith(".mlp"):
            handles += CLOCK.hook(module, "moe")
        elif name.endswith("logits_processor"):
            handles += CLOCK.hook(module, "lm_head")
    return {"moe_blocks": len(moe), "hooks": len(handles), "held_bytes": held}


def _repack_timer() -> dict[str, float]:
    """Time every quant method's ``process_weights_after_loading`` during load (the MoE repack of
    plugin #2 and vLLM's own layouts), by wrapping vLLM's loader helper that calls them."""
    from vllm.model_executor.model_loader import base_loader, utils

    spent = {"s": 0.0, "calls": 0.0}
    original = utils.process_weights_after_loading

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent["s"] += time.perf_counter() - t0
            spent["calls"] += 1

    utils.process_weights_after_loading = timed
    if getattr(base_loader, "process_weights_after_loading", None) is original:
        base_loader.process_weights_after_loading = timed
    return spent


def _moe_repack_timer() -> dict[str, float]:
    """Seconds inside the MoE methods' own ``process_weights_after_loading`` (the layout change
    from the checkpoint's MXFP4 to the kernel's: plugin #2's load-time repack), whatever class the
    registry chose: every MoE method instance built from now on gets a timed bound method."""
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    spent = {"s": 0.0, "layers": 0.0}
    base_init = FusedMoEMethodBase.__init__

    def init_and_wrap(self: Any, *args: Any, **kwargs: Any) -> None:
        base_init(self, *args, **kwargs)
        original = self.process_weights_after_loading

        def timed(layer: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(layer)
            finally:
                spent["s"] += time.perf_counter() - t0
                spent["layers"] += 1

        self.process_weights_after_loading = timed

    FusedMoEMethodBase.__init__ = init_and_wrap  # type: ignore[method-assign]
    return spent


#: Variables that force an ISA below the host's (``--vllm-env``): torch's ATen kernels, oneDNN,
#: and any plugin kernel's ``..._ISA`` switch. The child reports what it ran with, so a forced
#: variant's result proves the forcing reached the process that measured it.
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def isa_report(torch_capability: str) -> dict[str, Any]:
    """torch's CPU capability as it runs here, and every ISA-forcing variable of this process."""
    forced = {k: v for k, v in sorted(os.environ.items()) if k in ISA_VARIABLES or k.endswith("_ISA")}
    return {"torch_cpu_capability": torch_capability, "forced": forced}


def main() -> None:
    model_dir = sys.argv[1]
    max_model_len = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    eager = len(sys.argv) > 3 and sys.argv[3] == "eager"  # else vLLM's default mode: compiled, traced once
    t0 = time.perf_counter()
    import vllm  # noqa: F401  (timed: the import is part of every start-up)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import_s = time.perf_counter() - t0
    loader = _repack_timer()
    moe_repack = _moe_repack_timer()
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, seed=0, skip_tokenizer_init=True, enforce_eager=eager, dtype="bfloat16",
              max_model_len=max_model_len, kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False,
              max_num_batched_tokens=max(max_model_len, 2048))
    engine_s = time.perf_counter() - t0
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, seed=0)
    t0 = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=list(range(100, 116)))], greedy, use_tqdm=False)
    warmup_s = time.perf_counter() - t0
    hooked = llm.apply_model(install_hooks)[0]
    reply({"ready": True, "import_s": import_s, "engine_s": engine_s, "weights_processing_s": loader["s"],
           "moe_repack_s": moe_repack["s"], "moe_repack_layers": moe_repack["layers"], "warmup_s": warmup_s,
           "since_exec_s": time.perf_counter() - T_START, "hooked": hooked})
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "finish":
            break
        if op not in ("generate", "split"):
            reply({"error": f"unknown op {op!r}"})
            continue
        params = SamplingParams(max_tokens=int(command["max_tokens"]), temperature=0.0, ignore_eos=True, seed=0)
        ids = command["prompts"] if "prompts" in command else [command["prompt"]]
        prompt = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in ids]
        CLOCK.spans.clear()
        CLOCK.enabled = op == "split"
        t0 = time.perf_counter()
        outputs = llm.generate(prompt, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        CLOCK.enabled = False
        reply({"seconds": elapsed, "tokens": list(outputs[0].outputs[0].token_ids),
               "split": CLOCK.decode_split() if op == "split" else None})
    from quantreg.testing.vllm_probes import inspect_moe_layers

    layers = [layer for worker in llm.apply_model(inspect_moe_layers) for layer in worker["layers"]]
    import torch

    reply({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "moe_methods": sorted({layer["quant_method"] for layer in layers}),
           "experts_cls": sorted({str(layer["experts_cls"]) for layer in layers}),
           "isa": isa_report(torch.backends.cpu.get_cpu_capability())})


if __name__ == "__main__":
    main()
