"""Peak memory of loading one MoE layer as bf16: ``hpu_mxfp4_dequant`` against vllm-gaudi's legacy path.

Why: on Gaudi the dequantised method must not need more device memory at load than the path it
replaces (vllm-gaudi with ``HPU_MXFP4_NATIVE`` unset: quant config stripped, bf16 parameters
allocated, packed experts dequantised inside ``GptOssModel.load_weights``).

Each measurement runs in a fresh process (``python -m bench.dequant_memory_bench --child PATH
SHAPE``); the number is the process's RSS high-water mark (``VmHWM``) minus its RSS after imports,
i.e. the most layer memory resident at any moment. CPU RSS stands for device memory, so every
allocation a device would commit is touched (parameters are zero-filled or filled, as a loader
fills them).

* ``ours``: the real ``HpuMxfp4DequantMoEMethod``: its ``create_weights`` allocates the uint8
  blocks/scales and bf16 biases, which are filled with checkpoint-like bytes (what vLLM's MXFP4
  loader does), then ``process_weights_after_loading`` decodes both projections to bf16 and drops
  the packed parameters. Minimal Gaudi doubles stand in for ``habana_frameworks`` (no kernel runs).
* ``legacy``: vllm-gaudi's ``convert_moe_packed_tensors`` (taken verbatim, by source, from the
  faithful double ``tests/e2e/vllm_gaudi_double/vllm_gaudi/models/gptoss_mxfp4.py``) on the layer's
  checkpoint tensors, copied into bf16 parameters allocated up front, one projection after the
  other, as ``_load_weights_mxfp4_dequantize_hpu`` does at TP=1.

Shapes: GPT-OSS-20B layer (32 experts, H=I=2880) and 120B layer (128 experts, H=I=2880). The
legacy path at 120B needs ~20 GB here (its int64 nibble indices for 33.5M rows at once), more
than this machine has free; ``--shapes`` picks what to run, and the 120B legacy peak is then
given by :func:`legacy_model_bytes`, the allocation count checked against the 20B measurement.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOUBLE = ROOT / "tests" / "e2e" / "vllm_gaudi_double" / "vllm_gaudi" / "models" / "gptoss_mxfp4.py"
SUPPORT = ROOT / "plugins" / "hpu_mxfp4" / "tests"
SHAPES = {"20b": (32, 2880, 2880), "120b": (128, 2880, 2880)}
GIB = float(1 << 30)


def vm_hwm() -> int:
    """Peak resident bytes of this process so far."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def vm_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def legacy_converter() -> Any:
    """``convert_moe_packed_tensors`` from the double's source, without importing vLLM."""
    tree = ast.parse(DOUBLE.read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "convert_moe_packed_tensors"]
    import torch

    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(DOUBLE), "exec"), namespace)
    return namespace["convert_moe_packed_tensors"]


def checkpoint_like(shape: tuple[int, ...], scales: bool) -> Any:
    """Random packed bytes, or E8M0 scale bytes in a weight-like range (2^-9 .. 2^0)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    if scales:
        return torch.randint(118, 128, shape, dtype=torch.uint8, generator=gen)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


def run_legacy(experts: int, hidden: int, inter: int) -> dict[str, float]:
    import torch

    convert = legacy_converter()
    base = vm_rss()
    # What vLLM allocates once the quant config is stripped (UnquantizedFusedMoEMethod): bf16 [E, 2I, H], [E, H, I]
    w13 = torch.zeros(experts, 2 * inter, hidden, dtype=torch.bfloat16)
    w2 = torch.zeros(experts, hidden, inter, dtype=torch.bfloat16)
    loaded = vm_rss() - base
    start = time.perf_counter()
    for param, rows, k in ((w13, 2 * inter, hidden), (w2, hidden, inter)):
        blocks = checkpoint_like((experts, rows, k // 32, 16), scales=False)  # the checkpoint tensors of this layer
        scale = checkpoint_like((experts, rows, k // 32), scales=True)
        weight = convert(blocks, scale)
        param.copy_(weight)
        del weight, blocks, scale
    seconds = time.perf_counter() - start
    return {"peak": vm_hwm() - base, "after": vm_rss() - base, "loaded": loaded, "seconds": seconds}


def install_gaudi_doubles() -> None:
    """Just enough of the Gaudi stack for the method to bind its op (no kernel is called here)."""
    import torch

    package = types.ModuleType("habana_frameworks")
    bridge = types.ModuleType("habana_frameworks.torch")
    package.torch = bridge  # type: ignore[attr-defined]
    sys.modules["habana_frameworks"] = package
    sys.modules["habana_frameworks.torch"] = bridge

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the memory bench runs no kernel")

    moe = types.SimpleNamespace(bias_mxfp4_fused_weights=never, mxfp4_fused_weights=never, bias_fused_weights=never,
                                fused_weights=never)
    torch.ops.hpu = types.SimpleNamespace(mixture_of_experts=moe)  # type: ignore[attr-defined]


def run_ours(experts: int, hidden: int, inter: int) -> dict[str, float]:
    import torch

    sys.path.insert(0, str(SUPPORT))
    from quantreg_hpu_mxfp4.method import HpuMxfp4DequantMoEMethod
    from quantreg_hpu_mxfp4.testing import FakeLayer, moe_config

    install_gaudi_doubles()
    config = moe_config(num_global=experts, num_local=experts, top_k=4, hidden=hidden, intermediate=inter, bias=True)
    method = HpuMxfp4DequantMoEMethod(config)
    base = vm_rss()
    layer = FakeLayer(method, config, None)  # create_weights: uint8 blocks/scales, bf16 biases (untouched)
    for name in ("w13_weight", "w2_weight"):  # what vLLM's MXFP4 loader writes into them
        getattr(layer, name).data.copy_(checkpoint_like(tuple(getattr(layer, name).shape), scales=False))
        getattr(layer, f"{name}_scale").data.copy_(checkpoint_like(tuple(getattr(layer, f"{name}_scale").shape),
                                                                   scales=True))
    layer.w13_bias.data.zero_()
    layer.w2_bias.data.zero_()
    loaded = vm_rss() - base
    start = time.perf_counter()
    method.process_weights_after_loading(layer)
    seconds = time.perf_counter() - start
    assert layer.w13_weight.dtype == torch.bfloat16 and not hasattr(layer, "w13_weight_scale")
    return {"peak": vm_hwm() - base, "after": vm_rss() - base, "loaded": loaded, "seconds": seconds}


def legacy_model_bytes(experts: int, hidden: int, inter: int, rows_per_chunk: int = 32768 * 1024) -> int:
    """The legacy path's peak by counting its live allocations (w13 step, the larger one).

    bf16 params w13 + w2, the w13 checkpoint blocks and scales, the bf16 ``out``; per chunk of
    ``rows_per_chunk`` rows, two int64 index tensors [rows, 16], the int32 scales copy, the bf16
    ``lut[idx]`` gather result [rows, 16] (one at a time) and the reshape's contiguous copy
    (none: already contiguous).
    """
    rows_total = experts * 2 * inter * (hidden // 32)
    chunk = min(rows_per_chunk, rows_total)
    params = 2 * experts * (2 * inter * hidden + hidden * inter)
    blocks = rows_total * 16
    scales = rows_total + 4 * rows_total  # uint8 + the int32 ``scales.to(int32) - 127``
    out = rows_total * 32 * 2
    temps = chunk * 16 * 8 * 2 + chunk * 16 * 2
    return params + blocks + scales + out + temps


def child(path: str, shape: str) -> None:
    experts, hidden, inter = SHAPES[shape]
    result = (run_ours if path == "ours" else run_legacy)(experts, hidden, inter)
    print(json.dumps(result))


def measure(path: str, shape: str) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-m", "bench.dequant_memory_bench", "--child", path, shape],
                          capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{path} {shape} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    data: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--child", nargs=2, metavar=("PATH", "SHAPE"))
    parser.add_argument("--shapes", default="20b:ours,20b:legacy,120b:ours",
                        help="comma-separated SHAPE:PATH pairs (120b:legacy needs ~20 GB free)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    results: dict[str, Any] = {}
    for item in args.shapes.split(","):
        shape, path = item.split(":")
        data = measure(path, shape)
        results[item] = data
        print(f"{shape:>5} {path:<7} peak {data['peak'] / GIB:6.2f} GiB  loaded {data['loaded'] / GIB:6.2f} GiB  "
              f"after {data['after'] / GIB:6.2f} GiB  ({data['seconds']:.1f} s)", flush=True)
    for shape in SHAPES:
        model = legacy_model_bytes(*SHAPES[shape])
        results[f"{shape}:legacy_model"] = {"peak": model}
        print(f"{shape:>5} legacy  model peak {model / GIB:6.2f} GiB (allocation count)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
