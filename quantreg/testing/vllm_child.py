"""The child of :func:`quantreg.testing.vllm_run.run_vllm`: ``python -m quantreg.testing.vllm_child REQUEST.json``.

Builds ``vllm.LLM`` from the request the parent wrote, looks at every MoE layer inside the
workers (:mod:`quantreg.testing.vllm_probes`), runs the requested worker checks, generates greedily
from token-id prompts, optionally probes every MoE block with a seeded input, and writes one
JSON result (plus a ``.pt`` of MoE outputs) for the parent to read. Every failure, vLLM's included,
becomes the result's ``error`` text and exit code 1: the parent reports, never raises.

Split out of ``vllm_run.py`` (issue 24: one idea per module): this side imports vLLM and torch,
the parent side neither.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from .. import settings
from ..writing import replace_file
from . import vllm_probes
from .vllm_run import LLM_KWARGS


def _child(request: dict[str, Any]) -> dict[str, Any]:
    timings: dict[str, float] = {}
    result: dict[str, Any] = {"runner_pid": os.getpid(), "timings": timings}
    t0 = time.monotonic()
    try:
        import vllm  # type: ignore[import-not-found,unused-ignore]
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt  # type: ignore[import-not-found,unused-ignore]

        result["vllm_version"] = getattr(vllm, "__version__", None)
        timings["import_vllm"] = time.monotonic() - t0

        kwargs = dict(LLM_KWARGS)
        kwargs.update(request.get("llm_kwargs") or {})
        if request.get("additional_config") is not None:
            kwargs["additional_config"] = request["additional_config"]
        t1 = time.monotonic()
        llm = LLM(model=request["model"], seed=request["seed"], **kwargs)
        timings["llm_init"] = time.monotonic() - t1

        t2 = time.monotonic()
        inspected = llm.apply_model(vllm_probes.inspect_moe_layers)
        result["worker_pids"] = [w["pid"] for w in inspected]
        # What quantreg's hook published in this (driver) process for its children to compare against.
        result["driver_fingerprint"] = settings.raw(settings.FINGERPRINT)
        result["worker_moe_layers"] = [w["layers"] for w in inspected]
        checks: dict[str, list[Any]] = {}
        result["worker_checks"] = checks
        for spec in request.get("worker_checks") or []:
            checks[spec] = llm.apply_model(partial(vllm_probes.run_worker_check, spec))

        params = SamplingParams(
            max_tokens=request["max_tokens"],
            temperature=0.0,
            logprobs=request["logprobs"],
            ignore_eos=True,
            seed=request["seed"],
        )
        prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        token_ids: list[list[int]] = []
        chosen: list[list[float]] = []
        tops: list[list[dict[str, float]]] = []
        for output in outputs:
            completion = output.outputs[0]
            ids = [int(t) for t in completion.token_ids]
            token_ids.append(ids)
            steps = completion.logprobs or []
            chosen.append([float(step[t].logprob) if t in step else math.nan for t, step in zip(ids, steps)])
            tops.append([{str(k): float(v.logprob) for k, v in step.items()} for step in steps])
        result["token_ids"] = token_ids
        result["logprobs"] = chosen
        result["top_logprobs"] = tops
        timings["generate"] = time.monotonic() - t2

        if request["probe_tokens"] > 0:
            import torch

            t3 = time.monotonic()
            probes = llm.apply_model(
                partial(vllm_probes.probe_moe_layers, tokens=request["probe_tokens"], seed=request["probe_seed"])
            )
            tensors = {name: torch.tensor(values, dtype=torch.float32) for name, values in probes[0].items()}
            buffer = io.BytesIO()
            torch.save(tensors, buffer)
            replace_file(request["moe_outputs_path"], buffer.getvalue())
            result["moe_outputs_path"] = request["moe_outputs_path"]
            timings["probe"] = time.monotonic() - t3

    except BaseException:  # report, then let main() pick the exit code
        result["error"] = traceback.format_exc()
    timings["total"] = time.monotonic() - t0
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Child entry point: ``python -m quantreg.testing.vllm_child REQUEST.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("request", type=Path, help="request JSON written by run_vllm()")
    args = parser.parse_args(argv)
    request = json.loads(args.request.read_text())
    result = _child(request)
    replace_file(request["result_path"], json.dumps(result))
    if result.get("error"):
        print(result["error"], file=sys.stderr, flush=True)
        return 1
    return 0


# vLLM-CPU spawns its engine/worker processes, which re-import this module as __mp_main__; the
# guard keeps them from re-running the request. The functions handed to apply_model live in
# quantreg.testing.vllm_probes, so they pickle under that real name even though this module runs
# as __main__ (a ``__main__.<name>`` reference would not survive the hop to the worker).
if __name__ == "__main__":
    _code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip engine shutdown and interpreter teardown (several seconds with vLLM loaded): the
    # result is on disk and run_vllm() ends the engine/worker processes by process group.
    os._exit(_code)
