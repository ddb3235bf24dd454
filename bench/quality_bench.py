"""Quality beside speed: each engine's full-vocabulary distribution against the exact path's, on the same weights.

    python -m bench.quality_bench --layers 4 [--shape 20b|tiny] [--weights plain,planted]
        [--engines KEY,...] [--per-set 2 --length 384] [--json PATH]

Per weight set (``plain``: ``quantreg tiny-model``'s Gaussian weights; ``planted``: the same seed with
``--planted``, :mod:`quantreg.tiny.planted`), in one work directory under ``--work-dir``:

1. the checkpoint (written once) and the fixed prompts (:func:`bench.quality_metrics.prompt_sets`:
   3 sets x ``--per-set`` prompts x ``--length`` tokens, teacher-forced: every position's distribution
   of the next prompt token, ``per_set * 3 * (length - 1)`` positions);
2. the exact path (:mod:`bench.quality_exact`, fp32, MXFP4 dequantised exactly), its float64 check
   (prompt 0's first ``--check-tokens`` tokens through every layer in float64) and ``bf16ref`` (the
   same forward with every tensor vLLM holds in bf16 rounded to bf16 between fp32 ops: the size of
   "bf16 rounding", the registry default's bound);
3. every engine of ``--engines`` (:data:`ENGINES`), one process at a time, each writing its logits;
   then KL(exact || engine) per position, summarised as llama.cpp's ``--kl-divergence`` does
   (:mod:`bench.quality_metrics`), and the logits deleted (``--keep-logits`` keeps them).

vLLM engines run eager by default (``--vllm-mode``): the numerics are the same kernels compiled or not,
up to how the compiled glue (norms, residual adds, rotary) rounds -- the ``vllm-default-compiled``
engine measures that on the registry's choice. Each prompt is one forward (one prefill) unless
``--max-batched N`` chunks it, so methods chosen by token count (``tokens:`` rules) run their
prefill side here.

The JSON (``--json``, default ``bench/results/quality-L{N}.json``) is updated in place: re-running with
``--engines`` replaces just those rows (e.g. plugin #3's after its kernel changes) and keeps the rest;
``bench/quality_report.py`` prints the markdown table and draws the plot from it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cli_args import Parser, decimal, whole
from bench.common import ROOT, machine, python_env
from bench.quality_metrics import engine_metrics, prompt_sets
from bench.wholemodel_bench import DEFAULT_LLAMA_ENV, DEFAULT_WORK, ensure_gguf, llama_python, mem_available

#: key -> (label, kind, table source). Table sources: None (registry's choice), ``module:NAME``
#: (``python -m NAME`` prints the table's path), ``glob:PATTERN`` (first match under bench/tables),
#: ``file:PATH``; llama engines name their GGUF dense type.
ENGINES: dict[str, tuple[str, str, str | None]] = {
    "vllm-default": ("vLLM + quantreg, registry's choice", "vllm", None),
    "vllm-q8": ("vLLM + quantreg, plugin #2 q8.yaml (experts q8)", "vllm", "module:quantreg_cpu_mxfp4"),
    "vllm-int8-dense": ("vLLM + quantreg, plugin #3 dense int8 table", "vllm", "module:quantreg_cpu_int8_dense"),
    "vllm-q8-int8-dense": ("vLLM + quantreg, q8 experts + dense int8 (bench/tables/experts-q8-dense-int8.yaml)",
                           "vllm", "file:bench/tables/experts-q8-dense-int8.yaml"),
    "vllm-tuned": ("vLLM + quantreg, tune's table", "vllm", "glob:tuned-*.yaml"),
    "vllm-default-compiled": ("vLLM + quantreg, registry's choice, default (compiled) mode", "vllm", None),
    "llama-q8_0": ("llama.cpp, dense Q8_0", "llama", "q8_0"),
    "llama-bf16": ("llama.cpp, dense bf16", "llama", "bf16"),
}
DEFAULT_ENGINES = ("vllm-default", "vllm-q8", "vllm-int8-dense", "vllm-q8-int8-dense", "vllm-tuned",
                   "llama-q8_0", "llama-bf16")


def log(message: str) -> None:
    print(f"[quality] {message}", file=sys.stderr, flush=True)


def ensure_checkpoint(work: Path, shape: str, layers: int, seed: int, planted: bool) -> Path:
    """``quantreg tiny-model DIR --shape S --layers N [--planted]``, written once."""
    model = work / f"gpt-oss-{shape}-L{layers}-seed{seed}{'-planted' if planted else ''}"
    if (model / "config.json").is_file():
        return model
    log(f"writing {model}")
    subprocess.run([sys.executable, "-m", "quantreg", "tiny-model", str(model), "--shape", shape, "--layers",
                    str(layers), "--seed", str(seed), *(["--planted"] if planted else [])], check=True,
                   env=python_env())
    return model


def table_for(source: str | None) -> Path | None:
    """The table file an engine's source names (see :data:`ENGINES`)."""
    if source is None:
        return None
    kind, _, value = source.partition(":")
    if kind == "module":
        out = subprocess.run([sys.executable, "-m", value], check=True, capture_output=True, text=True,
                             env=python_env()).stdout.strip()
        return Path(out)
    if kind == "glob":
        found = sorted((ROOT / "bench" / "tables").glob(value))
        if not found:
            raise FileNotFoundError(f"no bench/tables/{value}")
        return found[0]
    return ROOT / value


def run_child(argv: list[str], env: dict[str, str], label: str, timeout: float) -> dict[str, Any]:
    """Run one engine child; its ``QRB`` line as a dict (stderr kept in a log beside the logits)."""
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line[4:] for line in proc.stdout.splitlines() if line.startswith("QRB ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or "").splitlines()[-25:])
        raise RuntimeError(f"{label}: exit {proc.returncode}\n{tail}")
    reply: dict[str, Any] = json.loads(lines[-1])
    return reply


def run_engine(key: str, model: Path, prompts_file: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    label, kind, source = ENGINES[key]
    t0 = time.perf_counter()
    if kind == "llama":
        python = llama_python(args.llama_env)
        if python is None:
            return {"label": label, "skipped": f"no finished llama environment at {args.llama_env} "
                                               "(bench/llama_setup.sh)"}
        gguf = ensure_gguf(model, str(source), args.llama_env)
        argv = [str(python), str(ROOT / "bench" / "quality_llama_child.py"), str(gguf), str(prompts_file), str(work),
                key, str(args.threads)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        detail: dict[str, Any] = {"gguf": gguf.name, "dense": source}
    else:
        table = table_for(source)
        mode = "default" if key.endswith("-compiled") else args.vllm_mode
        env = python_env(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", PYTHONHASHSEED="0",
                         OMP_NUM_THREADS=str(args.threads),
                         VLLM_CPU_OMP_THREADS_BIND="0" if args.threads == 1 else f"0-{args.threads - 1}")
        env.pop("QUANTREG_CONFIG", None)
        if table is not None:
            env["QUANTREG_CONFIG"] = str(table)
        argv = [sys.executable, "-m", "bench.quality_vllm_child", str(model), str(prompts_file), str(work), key, mode,
                str(args.max_batched)]
        detail = {"table": None if table is None else os.path.relpath(table, ROOT) if str(table).startswith(
            str(ROOT)) else str(table), "mode": mode}
    log(f"{key}: running ({label})")
    reply = run_child(argv, env, label, args.timeout)
    return {"label": label, "kind": kind, **detail, "child": reply, "wall_s": time.perf_counter() - t0}


def exact_paths(model: Path, prompts_file: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The exact path, its float64 check and the bf16-rounded forward (each reused when present)."""
    base = [sys.executable, "-m", "bench.quality_exact", str(model), str(prompts_file), str(work),
            "--threads", str(args.threads)]
    runs = {"exact": [], "check": ["--dtype", "float64", "--only", "0", "--tokens", str(args.check_tokens)],
            "bf16ref": ["--dtype", "bf16store"]}
    reports: dict[str, Any] = {}
    for tag, extra in runs.items():
        report = work / ("check-float64.json" if tag == "check" else f"{tag}.json")
        if not report.is_file():
            log(f"exact path: {tag}")
            subprocess.run(base + extra, check=True, cwd=ROOT, env=python_env())
        reports[tag] = json.loads(report.read_text())
    return reports


def check_metrics(work: Path, prompts: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """The fp32 exact path against its float64 check, on the check's positions."""
    import numpy as np

    from bench.quality_metrics import compare, kl_metrics

    rows = min(tokens, len(prompts[0]["ids"])) - 1
    exact = np.load(work / "exact-0.npy", mmap_mode="r")[:rows]
    np.save(work / "check-exact-0.npy", np.asarray(exact))
    kl, same = compare(work / "check-float64-0.npy", work / "check-exact-0.npy", engine_is_logprobs=True)
    diff = float(np.abs(np.load(work / "check-float64-0.npy").astype(np.float64) - np.asarray(exact, np.float64)).max())
    (work / "check-exact-0.npy").unlink()
    return {**kl_metrics(kl, same), "max_abs_logprob_diff": diff}


def weight_set(name: str, args: argparse.Namespace, engines: list[str],
               save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    model = ensure_checkpoint(args.work_dir, args.shape, args.layers, args.seed, planted=name == "planted")
    config = json.loads((model / "config.json").read_text())
    work = args.work_dir / f"quality-{model.name}-{args.per_set}x{args.length}"
    work.mkdir(parents=True, exist_ok=True)
    prompts = prompt_sets(int(config["vocab_size"]), args.per_set, args.length)
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps({"prompts": prompts}) + "\n")
    exact = exact_paths(model, prompts_file, work, args)
    out: dict[str, Any] = {"model": model.name, "positions": sum(len(p["ids"]) - 1 for p in prompts),
                           "prompts": {s: sum(1 for p in prompts if p["set"] == s) for s in ("text", "random",
                                                                                          "delimited")},
                           "exact": {"seconds": exact["exact"]["seconds"], "layers": exact["exact"]["layers"]},
                           "exact_check": check_metrics(work, prompts, args.check_tokens),
                           "bf16ref": engine_metrics(work, "bf16ref", prompts, engine_is_logprobs=True),
                           "engines": {}}
    log(f"{name}: exact vs float64 {out['exact_check']['kl_max']:.2e} max KL; bf16ref mean KL "
        f"{out['bf16ref']['kl_mean']:.2e}")
    for key in engines:
        waited = 0
        while args.min_free_gb and mem_available() < args.min_free_gb * 1e9:
            if waited >= args.timeout:
                raise SystemExit(f"{key}: only {mem_available() / 1e9:.1f} GB available for {waited} s, "
                                 f"--min-free-gb {args.min_free_gb}: re-run later with --engines {key}")
            if waited % 300 == 0:
                log(f"{key}: {mem_available() / 1e9:.1f} GB available < {args.min_free_gb} GB: waiting")
            time.sleep(15)
            waited += 15
        try:
            result = run_engine(key, model, prompts_file, work, args)
            if "skipped" not in result:
                result["metrics"] = engine_metrics(work, key, prompts)
                log(f"{name} {key}: mean KL {result['metrics']['kl_mean']:.3e}, p99 {result['metrics']['kl_p99']:.3e}"
                    f", same top {result['metrics']['same_top']:.4f}")
        except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
            result = {"label": ENGINES[key][0], "error": str(exc)[-3000:]}
            log(f"{name} {key}: FAILED {str(exc)[-600:]}")
        if not args.keep_logits:
            for f in work.glob(f"{key}-*.npy"):
                f.unlink()
        out["engines"][key] = result
        save(out)  # after every engine: a long run that stops keeps what it measured
    if args.drop_gguf:
        for f in model.parent.glob(f"{model.name}-*.gguf"):
            f.unlink()
    return out


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=whole(1, 64), default=4)
    parser.add_argument("--shape", choices=("20b", "tiny"), default="20b")
    parser.add_argument("--seed", type=whole(0, 2**31 - 1), default=0)
    parser.add_argument("--weights", default="plain,planted")
    parser.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                        help=f"comma-separated keys of: {', '.join(ENGINES)}")
    parser.add_argument("--per-set", type=whole(1, 64), default=2)
    parser.add_argument("--length", type=whole(2, 65536), default=384)
    parser.add_argument("--check-tokens", type=whole(0, 65536), default=160)
    parser.add_argument("--threads", type=whole(1, 4096), default=2)
    parser.add_argument("--vllm-mode", choices=("eager", "default"), default="eager")
    parser.add_argument("--max-batched", type=whole(0, 1 << 20), default=0,
                        help="vLLM max_num_batched_tokens (0: whole prompt)")
    parser.add_argument("--min-free-gb", type=decimal(0.0, 4096.0), default=0.0)
    parser.add_argument("--timeout", type=decimal(1.0, 7 * 86400.0), default=3600.0)
    parser.add_argument("--keep-logits", action="store_true")
    parser.add_argument("--drop-gguf", action="store_true",
                        help="delete each weight set's GGUF files after its llama.cpp engines ran (disk)")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK)
    parser.add_argument("--llama-env", type=Path, default=DEFAULT_LLAMA_ENV)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    if unknown or any(w not in ("plain", "planted") for w in weights):
        raise SystemExit(f"--engines: unknown {unknown}; known: {', '.join(ENGINES)}; --weights: plain,planted")
    path = args.json or ROOT / "bench" / "results" / f"quality-L{args.layers}.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    data.update({"bench": "quality", "layers": args.layers, "shape": args.shape, "seed": args.seed,
                 "machine": machine(), "per_set": args.per_set, "length": args.length,
                 "vllm_mode": args.vllm_mode, "max_batched": args.max_batched})
    data.setdefault("weights", {})
    for name in weights:
        old = data["weights"].get(name, {})

        def save(result: dict[str, Any], name: str = name, old: dict[str, Any] = old) -> None:
            data["weights"][name] = {**result, "engines": {**old.get("engines", {}), **result["engines"]}}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data, indent=1) + "\n")

        save(weight_set(name, args, engines, save))
        log(f"wrote {path}")
    from bench.quality_report import markdown

    print(markdown(data))


if __name__ == "__main__":
    main()
