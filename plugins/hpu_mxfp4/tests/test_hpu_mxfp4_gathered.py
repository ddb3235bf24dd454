"""``hpu_mxfp4_gathered`` (vllm-gaudi #1731's gathered path) on this CPU, through the Gaudi doubles.

The doubles (:mod:`quantreg_hpu_mxfp4.testing`) check every argument the kernel receives (tuple
lengths against ``experts_min..experts_max``, dtypes, the int32 routing table, block size,
``permuted_weights``) and compute with the pure-torch reference. Here: the gathered op hands the
kernel one slot per routed (token, expert) pair, views of exactly the experts each token chose
(nothing copied), a table sending each token to its own slots, a choice outside this rank's
experts to no slot; and its output is the fused op's (``hpu_mxfp4`` over every local expert)
and within the plugin's bound of float64. Only on Gaudi (not run here): the kernel itself, its
``hpu_backend`` compilation, the time either path takes.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

pytest.importorskip("vllm")
from quantreg_hpu_mxfp4 import method as methods
from quantreg_hpu_mxfp4 import plugin
from quantreg_hpu_mxfp4.testing import FakeLayer, make_experts, moe_config, oracle, rel_error

import quantreg

pytestmark = pytest.mark.vllm  # imports vLLM (the classes subclass its MXFP4 method)

GLOBAL, LOCAL, TOP_K, HIDDEN, INTER = 8, 4, 2, 64, 64
EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "examples" / "gaudi-gathered-crossover.yaml"


def build(cls: type, *, bias: bool, ep_rank: int, seed: int = 3) -> tuple[Any, FakeLayer, Any]:
    moe = moe_config(num_global=GLOBAL, num_local=LOCAL, top_k=TOP_K, hidden=HIDDEN, intermediate=INTER,
                     bias=bias, activation="swigluoai" if bias else "silu", ep_rank=ep_rank, dp_size=1)
    experts = make_experts(LOCAL, HIDDEN, INTER, bias=bias, seed=seed)
    method = cls(moe)
    return method, FakeLayer(method, moe, experts), experts


@pytest.mark.parametrize("ep_rank", [0, 1])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_gathered_kernel_gets_one_slot_per_routed_pair(hpu: Any, vllm_gaudi: Any, tokens: int, bias: bool,
                                                       ep_rank: int) -> None:
    gathered, layer, experts = build(methods.HpuMxfp4GatheredMoEMethod, bias=bias, ep_rank=ep_rank)
    fused, fused_layer, _ = build(methods.HpuMxfp4MoEMethod, bias=bias, ep_rank=ep_rank)
    g = torch.Generator().manual_seed(tokens * 10 + ep_rank)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(GLOBAL, generator=g)[:TOP_K] for _ in range(tokens)]).to(torch.int32)
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g), dim=-1).to(torch.bfloat16)

    out = gathered.apply(layer, x, weights, ids)

    (call,) = hpu.calls
    slots = tokens * TOP_K
    assert call.name == ("bias_mxfp4_fused_weights" if bias else "mxfp4_fused_weights")
    assert (call.kwargs["experts_min"], call.kwargs["experts_max"]) == (0, slots - 1)
    assert (call.kwargs["chunk_size"], call.kwargs["total_experts"]) == (0, 0)  # moe_chunk tunes the fused op only
    local = ids.reshape(-1).long() - ep_rank * LOCAL
    owned = (local >= 0) & (local < LOCAL)
    want_table = torch.where(owned, torch.arange(slots), torch.full_like(local, slots)).view(tokens, TOP_K)
    assert call.args[1].dtype == torch.int32 and torch.equal(call.args[1].long(), want_table)
    assert torch.equal(call.args[2], weights)
    for slot, expert in enumerate(local.tolist()):  # the views of the chosen experts, never copies
        e = min(max(expert, 0), LOCAL - 1)
        assert call.args[3][slot].data_ptr() == layer.w13_weight.data[e].data_ptr()
        assert call.args[4][slot].data_ptr() == layer.w2_weight.data[e].data_ptr()
    assert hpu.compiled == ["forward"]

    hpu.calls.clear()
    want = fused.apply(fused_layer, x, weights, ids)  # the fused op over every local expert
    assert (hpu.calls[0].kwargs["experts_min"], hpu.calls[0].kwargs["experts_max"]) == (
        ep_rank * LOCAL, ep_rank * LOCAL + LOCAL - 1)
    assert out.shape == want.shape == x.shape
    assert rel_error(out, want) <= 1e-3  # the same sums, in slot order instead of expert order
    if bias:
        assert rel_error(out, oracle(x, ids, weights, experts, ep_rank * LOCAL)) <= 1e-2


def test_a_token_routed_only_outside_this_rank_gets_zeros(hpu: Any, vllm_gaudi: Any) -> None:
    method, layer, _ = build(methods.HpuMxfp4GatheredMoEMethod, bias=True, ep_rank=0)
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    ids = torch.tensor([[5, 6], [0, 7]], dtype=torch.int32)  # token 0: experts 5, 6 live on rank 1
    weights = torch.full((2, TOP_K), 0.5, dtype=torch.bfloat16)
    out = method.apply(layer, x, weights, ids)
    assert hpu.calls[0].args[1].tolist() == [[4, 4], [2, 4]]  # outside 0..3: no slot
    assert torch.count_nonzero(out[0]) == 0 and torch.count_nonzero(out[1]) > 0


def test_registered_for_gaudi_only_and_probed_like_the_native_kernel() -> None:
    registry = quantreg.Registry.build(env={})
    method = registry.methods["hpu_mxfp4_gathered"]
    assert (method.plugin, method.devices, method.expert_layout) == ("hpu_mxfp4", ("hpu",), "packed")
    assert method.probe == registry.methods["hpu_mxfp4"].probe
    assert method.options == plugin.OPTIONS
    if importlib.util.find_spec("habana_frameworks") is None:
        avail = registry.availability_for("hpu_mxfp4_gathered", quantreg.Key("gpt_oss_mxfp4", "gpt_oss", "hpu"))
        assert not avail.ok and "habana_frameworks" in avail.reason


def test_the_example_table_is_the_two_sides_of_one_bound() -> None:
    """docs/examples/gaudi-gathered-crossover.yaml: the gathered kernel up to 64 / top_k tokens, the fused op above."""
    rules = yaml.safe_load(EXAMPLE.read_text())["rules"]
    small, large = rules
    assert (small["match"]["tokens"], large["match"]["tokens"]) == ("<=16", ">16")  # 64 slots / GPT-OSS's top-4
    assert small["method"][0] == "hpu_mxfp4_gathered" and large["method"][0] == "hpu_mxfp4"
    assert small["verify"]["against"] == "hpu_mxfp4" and small["verify"]["decoders"] == 40
    for variable in ("VLLM_HPU_MOE_GATHER=1", "VLLM_HPU_MOE_GATHER_MAX_TP=64", "VLLM_HPU_MOE_GATHER_VERIFY=1",
                     "VLLM_HPU_MOE_GATHER_VERIFY_DIR", "VLLM_HPU_MOE_GATHER_VERIFY_LAYERS=40"):
        assert variable in EXAMPLE.read_text()


def test_each_rule_of_the_example_is_valid_without_its_tokens_key(tmp_path: Path) -> None:
    """Methods, verify and options of the example load today (real loader, real CLI)."""
    for i, rule in enumerate(yaml.safe_load(EXAMPLE.read_text())["rules"]):
        rule["match"].pop("tokens")
        path = tmp_path / f"rule-{i}.yaml"
        path.write_text(yaml.safe_dump({"version": 1, "rules": [rule]}, sort_keys=False))
        out = subprocess.run([sys.executable, "-m", "quantreg", "validate", str(path)], capture_output=True,
                             text=True, timeout=120, cwd=tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr


def test_the_example_table_validates() -> None:
    out = subprocess.run([sys.executable, "-m", "quantreg", "validate", str(EXAMPLE)], capture_output=True,
                         text=True, timeout=120, cwd=EXAMPLE.parent)
    assert out.returncode == 0, out.stdout + out.stderr
