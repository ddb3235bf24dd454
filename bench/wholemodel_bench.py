"""A whole GPT-OSS at real width: vLLM-CPU + quantreg against llama.cpp, same weights, same host, one run.

    python -m bench.wholemodel_bench --layers 4 [--rounds 3] [--vllm-table LABEL=TABLE.yaml ...]

What it does, in one process tree of the repository's ``.venv``:

1. the checkpoint: ``quantreg tiny-model DIR --shape 20b --layers N`` (GPT-OSS-20B's real sizes,
   MXFP4 experts, random weights from a seed), written once under ``--work-dir``;
2. the same weights as GGUF, by llama.cpp's own converter (``bench/gguf_convert.py``), dense at
   each ``--llama-dense`` type (default ``q8_0`` -- what users of the published GGUF run -- and
   ``bf16``, the same bytes vLLM holds); MXFP4 experts kept;
3. the engines, each its own process, started one after another (start-up timed alone): every
   vLLM variant (``--vllm-table``; default one variant, the registry's own choice on this host --
   plugin #2 ``cpu_mxfp4`` without AMX, vLLM's kernel with AMX) and llama.cpp (llama-cpp-python from
   ``bench/llama_setup.sh``'s environment) per dense type, all with ``--threads`` threads;
4. ``--rounds`` rounds, engines interleaved and rotated (A B C, B C A, ...), each round: the host's
   read bandwidth (a 1 GiB sum), then per engine time-to-first-token (16-token prompt, 1 token),
   decode (same prompt, ``--decode-tokens`` tokens; tokens/s = (N - 1) / (t_N - t_1), prefill
   subtracted) and prefill (``--prefill-tokens`` prompt, 1 token);
5. vLLM's decode step split (MoE, attention + dense, lm_head, the rest) from a separate hooked call,
   eager variants only; ``--split-sequences 16`` also splits the step of 16 sequences decoding
   together (what a server's step is under 16 streaming clients, issue 45);
6. bytes read per decoded token from the weights each engine holds (experts x top_k / E, one
   embedding row, every other weight whole) and that x tokens/s as a fraction of the bandwidth.

``--vllm-table LABEL=TABLE.yaml`` (repeatable) adds a vLLM variant served with that quantreg table
(``QUANTREG_CONFIG``), e.g. ``--vllm-table "vLLM + quantreg + dense int8=dense.yaml"`` once a table
with ``layer:`` rules exists; ``--no-default-vllm`` drops the table-less variant. ``--vllm-env
LABEL=KEY=VALUE`` (repeatable) gives one variant an environment variable, e.g. the ISA-forcing ones
(``QUANTREG_CPU_MXFP4_ISA=avx2``, ``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``) for the
AVX2 host kind on an AVX-512 host; the child reports the ISA it ran at. ``--llama-build
NAME=ENV_DIR`` (repeatable) adds another llama.cpp build on the same GGUF (``QUANTREG_LLAMA_ISA=avx2
bench/llama_setup.sh`` makes the AVX2 one).

Engines stay alive together (memory: about the checkpoint per vLLM variant plus each GGUF);
``--one-at-a-time`` runs them one after another instead (for sizes where they do not fit together),
all rounds of one engine then the next; ``--alternate`` also runs them one at a time but restarted
every round, in the rotated order (A B C, B C A, ...): the host's drift (on a shared VM llama.cpp's
own decode moved 8.7-10.1 tok/s between runs) then falls on every engine alike, and the JSON keeps
each round's ratio to every llama.cpp build (engines measured minutes apart, not tens of minutes).

Results: a table on stdout and JSON (``--json``, default ``bench/results/wholemodel-L{N}.json``);
``bench/wholemodel_report.py`` turns several of them into docs/benchmarks.md's table and plot.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cli_args import Parser, fail, model_config, whole, whole_list
from bench.common import (
    DISAGREE_FACTOR,
    ROOT,
    command_line,
    disagreement,
    load_average,
    machine,
    median,
    python_env,
    read_reply,
    run_and_report,
    skipped_lines,
    table_head,
)

DEFAULT_WORK = Path(os.environ.get("QUANTREG_BENCH_DIR", Path.home() / ".cache" / "quantreg-bench"))
DEFAULT_LLAMA_ENV = Path(os.environ.get("QUANTREG_LLAMA_ENV", DEFAULT_WORK / "llama-venv"))
CONVERTER = "src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py"
DEFAULT_VLLM_LABEL = "vLLM-CPU + quantreg (registry's choice)"
SHORT_PROMPT = 16


def llama_python(env: Path) -> Path | None:
    """The llama environment's interpreter, or None while ``bench/llama_setup.sh`` has not finished."""
    python = env / "bin" / "python"
    return python if (env / ".ready").is_file() and python.is_file() else None


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def checkpoint_bytes(model: Path) -> int:
    return sum(p.stat().st_size for p in model.glob("*.safetensors"))


# -- preparing the weights --------------------------------------------------------------------
def ensure_checkpoint(work: Path, shape: str, layers: int, seed: int) -> Path:
    """The checkpoint directory, written by ``quantreg tiny-model`` when missing."""
    model = work / f"gpt-oss-{shape}-L{layers}-seed{seed}"
    if (model / "config.json").is_file():
        return model
    print(f"[wholemodel] writing {model} (quantreg tiny-model --shape {shape} --layers {layers})", file=sys.stderr,
          flush=True)
    subprocess.run([sys.executable, "-m", "quantreg", "tiny-model", str(model), "--shape", shape, "--layers",
                    str(layers), "--seed", str(seed)], check=True, env=python_env())
    return model


def ensure_gguf(model: Path, dense: str, llama_env: Path) -> Path:
    """``MODEL-<dense>.gguf`` beside the checkpoint, made by llama.cpp's converter when missing."""
    out = model.parent / f"{model.name}-{dense}.gguf"
    if out.is_file():
        return out
    python = llama_python(llama_env)
    if python is None:
        raise RuntimeError(f"no llama environment at {llama_env}: run bench/llama_setup.sh first")
    print(f"[wholemodel] converting to {out} (llama.cpp convert_hf_to_gguf.py --outtype {dense})", file=sys.stderr,
          flush=True)
    partial = out.with_suffix(".partial")
    subprocess.run([str(python), str(ROOT / "bench" / "gguf_convert.py"), str(llama_env / CONVERTER), str(model),
                    "--outtype", dense, "--outfile", str(partial)], check=True)
    partial.rename(out)
    return out


# -- engines ------------------------------------------------------------------------------
@dataclass
class Engine:
    """One engine process answering one JSON command per line (``bench/wholemodel_*_child.py``)."""

    label: str
    kind: str  # "vllm" | "llama"
    argv: list[str]
    env: dict[str, str]
    detail: dict[str, Any] = field(default_factory=dict)
    proc: subprocess.Popen[str] | None = None
    stderr: IO[str] | None = None
    ready: dict[str, Any] = field(default_factory=dict)
    startup_s: float = 0.0
    final: dict[str, Any] = field(default_factory=dict)

    def start(self) -> None:
        self.stderr = tempfile.TemporaryFile(mode="w+")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, bufsize=1)
        self.ready = self.read()
        self.startup_s = time.perf_counter() - t0

    def read(self) -> dict[str, Any]:
        assert self.proc is not None and self.stderr is not None
        return read_reply(self.proc, self.stderr, self.label, 6000)

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def finish(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.final = self.ask(op="finish")
            self.proc.wait(timeout=120)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)
        if self.stderr is not None:
            self.stderr.close()


def cpu_binding(threads: int) -> str:
    return f"0-{threads - 1}" if threads > 1 else "0"


#: vLLM's modes: its default (the model compiled, traced once: what `vllm serve` does) and eager
#: (``--enforce-eager``); a variant measured in both gets the eager one labelled with this suffix.
VLLM_MODES = ("default", "eager")
EAGER_SUFFIX = " [eager]"


def vllm_engine(label: str, table: Path | None, model: Path, threads: int, max_len: int,
                mode: str = "default", extra_env: dict[str, str] | None = None) -> Engine:
    env = python_env(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=cpu_binding(threads),
                     VLLM_CPU_KVCACHE_SPACE="1", PYTHONHASHSEED="0", OMP_NUM_THREADS=str(threads))
    env.pop("QUANTREG_CONFIG", None)
    if table is not None:
        env["QUANTREG_CONFIG"] = str(table.resolve())
    env.update(extra_env or {})
    detail: dict[str, Any] = {"table": None if table is None else str(table), "mode": mode}
    if extra_env:
        detail["env"] = dict(extra_env)
    return Engine(label, "vllm", [sys.executable, "-m", "bench.wholemodel_vllm_child", str(model), str(max_len), mode],
                  env, detail=detail)


def variant_env(items: list[str], labels: list[str]) -> dict[str, dict[str, str]]:
    """``--vllm-env LABEL=KEY=VALUE`` items -> {label: {KEY: VALUE}}, each label one of the variants."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        label, sep, assignment = item.partition("=")
        key, sep2, value = assignment.partition("=")
        if not (sep and sep2 and label and key.isidentifier()):
            fail(f"argument --vllm-env expects LABEL=KEY=VALUE, got {item!r}")
        if label not in labels:
            fail(f"argument --vllm-env {item!r}: no vLLM variant labelled {label!r} (variants: {', '.join(labels)})")
        out.setdefault(label, {})[key] = value
    return out


def vllm_modes(text: str) -> list[str]:
    """``--vllm-modes``: a comma-separated subset of :data:`VLLM_MODES`, in that order."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in VLLM_MODES]
    if bad or not modes:
        fail(f"argument --vllm-modes expects a comma-separated subset of {', '.join(VLLM_MODES)}, got {text!r}")
    return [m for m in VLLM_MODES if m in modes]


def llama_engine(dense: str, gguf: Path, llama_env: Path, threads: int, max_len: int, build: str = "") -> Engine:
    python = llama_python(llama_env)
    assert python is not None
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    name = f"llama.cpp {build}" if build else "llama.cpp"
    return Engine(f"{name}, dense {dense}", "llama",
                  [str(python), str(ROOT / "bench" / "wholemodel_llama_child.py"), str(gguf), str(threads),
                   str(max_len)], env, detail={"gguf": str(gguf), "dense": dense, "env": str(llama_env)})


def llama_builds(items: list[str]) -> list[tuple[str, Path]]:
    """``--llama-build NAME=ENV_DIR`` items -> [(name, env)], each env a finished llama_setup.sh environment."""
    out = []
    for item in items:
        name, sep, path = item.partition("=")
        if not (sep and name and path):
            fail(f"argument --llama-build expects NAME=ENV_DIR, got {item!r}")
        if llama_python(Path(path)) is None:
            fail(f"argument --llama-build {name}: {path} is not a finished bench/llama_setup.sh environment "
                             "(QUANTREG_LLAMA_ISA=avx2 QUANTREG_LLAMA_ENV=DIR bench/llama_setup.sh makes one)")
        out.append((name, Path(path)))
    return out


def sessions(labels: list[str], rounds: int, layout: str) -> list[tuple[list[str], list[int]]]:
    """Which engines live together and which rounds each such session runs, in order.

    ``together``: one session of every engine for every round; ``one-at-a-time``: one engine's every
    round, then the next's; ``alternate``: one engine for one round, rotated (A B C, B C A, ...),
    so neighbouring measurements of different engines are minutes apart whatever the run's length."""
    if layout == "together":
        return [(list(labels), list(range(rounds)))]
    if layout == "one-at-a-time":
        return [([label], list(range(rounds))) for label in labels]
    if layout == "alternate":
        n = len(labels)
        return [([labels[(r + i) % n]], [r]) for r in range(rounds) for i in range(n)]
    raise ValueError(f"unknown layout {layout!r}")


# -- measuring ------------------------------------------------------------------------------
def read_bandwidth() -> float:
    """Bytes/s of the fastest of three sums over 1 GiB (a floor is a bound: the best read seen)."""
    import torch

    big = torch.ones((1 << 30) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t0)
    del big
    return (1 << 30) / best


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 199_000) for _ in range(n)]


def measure_round(engine: Engine, rng_seed: int, decode_tokens: int, prefill_tokens: int) -> dict[str, float]:
    rng = random.Random(rng_seed)
    short, long = prompt(rng, SHORT_PROMPT), prompt(rng, prefill_tokens)
    first = engine.ask(op="generate", prompt=short, max_tokens=1)
    decode = engine.ask(op="generate", prompt=short, max_tokens=decode_tokens)
    if len(decode["tokens"]) != decode_tokens:
        raise RuntimeError(f"{engine.label}: {len(decode['tokens'])} tokens, asked for {decode_tokens}")
    prefill = engine.ask(op="generate", prompt=long, max_tokens=1)
    return {"ttft_s": first["seconds"], "decode_s": decode["seconds"], "prefill_s": prefill["seconds"],
            "decode_tok_s": (decode_tokens - 1) / max(1e-9, decode["seconds"] - first["seconds"]),
            "prefill_tok_s": prefill_tokens / prefill["seconds"]}


def bytes_per_token_gguf(tensors: dict[str, Any], top_k: int, experts: int) -> dict[str, float]:
    """From the GGUF's tensor table: expert tensors (``*_exps``) x top_k/E, the embedding (one row),
    everything else whole."""
    held = {"experts": 0.0, "embedding": 0.0, "dense": 0.0}
    for name, info in tensors.items():
        key = "experts" if "_exps" in name else "embedding" if name.startswith("token_embd") else "dense"
        held[key] += info["bytes"]
    return held


def per_token(held: dict[str, float], top_k: int, experts: int, vocab: int) -> float:
    return held["dense"] + held["experts"] * top_k / experts + held["embedding"] / vocab


def split_step(engine: Engine, decode_tokens: int, seed: int, sequences: int = 1) -> dict[str, Any]:
    """vLLM's decode step split from one hooked generate (``_Clock.decode_split`` in the child), in ms;
    with ``sequences`` > 1 that many prompts decode together, every step serving all of them (the
    step a server runs under that many streaming clients)."""
    rng = random.Random(seed)
    prompts = [prompt(rng, SHORT_PROMPT) for _ in range(sequences)]
    split = engine.ask(op="split", prompts=prompts, max_tokens=decode_tokens)["split"]
    if not split.get("steps"):
        raise RuntimeError(f"{engine.label}: no decode step was timed ({split})")
    out = {key.replace("_s", "_ms"): value * 1e3 for key, value in split.items() if key.endswith("_s")}
    out.update({k: v for k, v in split.items() if not k.endswith("_s")})
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or ensure_checkpoint(work, args.shape, args.layers, args.seed)
    config = model_config(model, ("num_experts_per_tok", "num_local_experts", "vocab_size"))
    top_k, experts, vocab = (int(config["num_experts_per_tok"]), int(config["num_local_experts"]),
                             int(config["vocab_size"]))
    max_len = args.prefill_tokens + args.decode_tokens + 64
    variants: list[tuple[str, Path | None]] = [] if args.no_default_vllm else [(DEFAULT_VLLM_LABEL, None)]
    for item in args.vllm_table:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            fail(f"argument --vllm-table expects LABEL=TABLE.yaml, got {item!r}")
        if not Path(path).is_file():
            fail(f"argument --vllm-table {label}: {path} is not a file")
        variants.append((label, Path(path)))
    envs = variant_env(args.vllm_env, [label for label, _ in variants])
    builds = llama_builds(args.llama_build)
    engines = [vllm_engine(label + (EAGER_SUFFIX if mode == "eager" else ""), table, model, args.threads, max_len, mode,
                           envs.get(label))
               for label, table in variants for mode in vllm_modes(args.vllm_modes)]
    skipped: dict[str, str] = {}
    dense_types = [d for d in args.llama_dense.split(",") if d and d != "none"]
    if dense_types and llama_python(args.llama_env) is None:
        for d in dense_types:
            skipped[f"llama.cpp, dense {d}"] = (f"no llama environment at {args.llama_env} "
                                                "(bench/llama_setup.sh builds it, ~10-30 min)")
        dense_types = []
    for dense in dense_types:
        gguf = ensure_gguf(model, dense, args.llama_env)
        engines.append(llama_engine(dense, gguf, args.llama_env, args.threads, max_len))
        engines.extend(llama_engine(dense, gguf, env, args.threads, max_len, name) for name, env in builds)
    need = sum(checkpoint_bytes(model) if e.kind == "vllm" else Path(e.detail["gguf"]).stat().st_size
               for e in engines) + len(engines) * (1 << 30)
    available = mem_available()
    layout = "alternate" if args.alternate else "one-at-a-time" if args.one_at_a_time else "together"
    together = layout == "together"
    if together and need > available:
        raise SystemExit(f"the engines need ~{need / 1e9:.1f} GB together, {available / 1e9:.1f} GB available: "
                         "pass --one-at-a-time, --alternate or fewer layers")
    info = machine()
    results: dict[str, Any] = {e.label: {"kind": e.kind, **e.detail, "rounds": []} for e in engines}
    bandwidth: list[float] = []
    loads: list[Any] = [load_average()]
    started = time.time()

    by_label = {e.label: e for e in engines}
    plan = sessions(list(by_label), args.rounds, layout)
    last_session = {label: i for i, (group, _) in enumerate(plan) for label in group}

    def measure(index: int, group: list[Engine], rounds: list[int]) -> None:
        for e in group:
            print(f"[wholemodel] starting {e.label}", file=sys.stderr, flush=True)
            e.start()
            results[e.label].setdefault("startups_s", []).append(e.startup_s)
            if "startup_s" in results[e.label]:  # a restart (--alternate): the first start-up stays the one reported
                continue
            results[e.label]["startup_s"] = e.startup_s
            results[e.label]["startup_split"] = {k: v for k, v in e.ready.items()
                                                 if k not in ("tensors", "hooked", "ready")}
            if e.kind == "vllm":
                held = e.ready["hooked"]["held_bytes"]
            else:
                held = bytes_per_token_gguf(e.ready["tensors"], top_k, experts)
            results[e.label]["held_bytes"] = held
            results[e.label]["bytes_per_token"] = per_token(held, top_k, experts, vocab)
        for r in rounds:
            bandwidth.append(read_bandwidth())
            order = group[r % len(group):] + group[:r % len(group)]
            for e in order:
                print(f"[wholemodel] round {r + 1}/{args.rounds}: {e.label}", file=sys.stderr, flush=True)
                results[e.label]["rounds"].append(measure_round(e, 1000 + r, args.decode_tokens, args.prefill_tokens))
            loads.append(load_average())
        for e in group:
            last = last_session[e.label] == index
            if last and e.kind == "vllm" and e.detail.get("mode") == "eager":  # hooks do not fire in a compiled graph
                results[e.label]["split"] = split_step(e, args.decode_tokens, 99)
                for n in args.split_sequences:
                    results[e.label].setdefault("split_by_sequences", {})[str(n)] = split_step(
                        e, args.decode_tokens, 99, n)
            e.finish()
            results[e.label]["peak_rss_bytes"] = max(results[e.label].get("peak_rss_bytes") or 0,
                                                     e.final.get("peak_rss_bytes") or 0)
            if e.kind == "vllm":
                results[e.label]["moe_methods"] = e.final.get("moe_methods")
                results[e.label]["experts_cls"] = e.final.get("experts_cls")
                results[e.label]["isa"] = e.final.get("isa")

    try:
        if together:
            measure(0, engines, list(range(args.rounds)))
        else:  # one engine failing (a crash, an OOM kill) costs its row, not the others' measurements
            for index, (labels, rounds) in enumerate(plan):
                e = by_label[labels[0]]
                if e.label in skipped:
                    continue
                try:
                    measure(index, [e], rounds)
                except RuntimeError as exc:
                    results.pop(e.label, None)
                    skipped[e.label] = "failed: " + " | ".join(str(exc).strip().splitlines()[-3:])
                    print(f"[wholemodel] {e.label} failed, going on: {exc}", file=sys.stderr, flush=True)
                e.close()
    finally:
        for e in engines:
            e.close()
    if not results:
        raise SystemExit("no engine finished: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    bw = max(bandwidth or [read_bandwidth()])
    for r in results.values():
        for key in ("ttft_s", "decode_tok_s", "prefill_tok_s"):
            r[key] = median(x[key] for x in r["rounds"])
        r["spread"] = {key: disagreement(x[key] for x in r["rounds"]) for key in ("decode_tok_s", "prefill_tok_s")}
        r["bandwidth_fraction"] = r["bytes_per_token"] * r["decode_tok_s"] / bw
    baseline = next((label for label in results if results[label]["kind"] == "llama"), None)
    ratios: dict[str, Any] = {}
    for label, r in results.items():
        if r["kind"] != "vllm":
            continue
        for other, o in results.items():
            if o["kind"] == "llama":
                ratios[f"{label} / {other}"] = ratio = {"decode": r["decode_tok_s"] / o["decode_tok_s"],
                                                        "prefill": r["prefill_tok_s"] / o["prefill_tok_s"],
                                                        "ttft": r["ttft_s"] / o["ttft_s"]}
                if layout != "one-at-a-time":  # round r of both engines was measured close together
                    for key in ("decode", "prefill"):
                        per_round = [a[f"{key}_tok_s"] / b[f"{key}_tok_s"] for a, b in zip(r["rounds"], o["rounds"])]
                        ratio[f"{key}_rounds"] = per_round
                        ratio[f"{key}_round_median"] = median(per_round)
    info["load_averages"] = loads
    return {"model": str(model), "layers": int(config["num_hidden_layers"]),
            "shape": "20b" if int(config["hidden_size"]) == 2880 else "tiny", "config": {
                "hidden": config["hidden_size"], "experts": experts, "top_k": top_k, "vocab": vocab,
                "checkpoint_bytes": checkpoint_bytes(model)},
            "settings": {"threads": args.threads, "rounds": args.rounds, "decode_tokens": args.decode_tokens,
                         "prefill_tokens": args.prefill_tokens, "interleaved": together,
                         "layout": layout},
            "read_bandwidth_gb_s": bw / 1e9, "read_bandwidth_samples_gb_s": [b / 1e9 for b in bandwidth],
            "engines": results, "ratios": ratios, "baseline": baseline, "skipped": skipped, "machine": info,
            "duration_s": round(time.time() - started, 1),
            "command": command_line("bench.wholemodel_bench")}


def split_line(s: dict[str, Any]) -> str:
    return (f"{s['step_ms']:.1f} ms = MoE {s['moe_ms']:.1f} + attention/dense {s['attention_dense_ms']:.1f} + "
            f"lm_head {s['lm_head_ms']:.1f} + rest {s['rest_ms']:.1f}")


def table(result: dict[str, Any]) -> str:
    lines = table_head(f"GPT-OSS ({result['shape']} shape), {result['layers']} layers, "
                       f"{result['settings']['threads']} threads, host kind {result['machine']['host_kind']}, "
                       f"read bandwidth {result['read_bandwidth_gb_s']:.1f} GB/s",
                       ["engine", "decode tok/s", "prefill tok/s", "TTFT ms", "start-up s", "MB/token",
                        "of bandwidth", "peak RSS GB"])
    for label, r in result["engines"].items():
        lines.append(f"| {label} | {r['decode_tok_s']:.2f} | {r['prefill_tok_s']:.1f} | {r['ttft_s'] * 1e3:.0f} | "
                     f"{r['startup_s']:.1f} | {r['bytes_per_token'] / 1e6:.0f} | {r['bandwidth_fraction']:.0%} | "
                     f"{(r['peak_rss_bytes'] or 0) / 1e9:.2f} |")
    for label, r in result["engines"].items():  # the rounds' range, and a flag where they disagree
        for key, name in (("decode_tok_s", "decode"), ("prefill_tok_s", "prefill")):
            sp = r.get("spread", {}).get(key)
            if sp:
                flag = f" ROUNDS DISAGREE (>x{DISAGREE_FACTOR}): the median stands for neither" * sp["disagree"]
                lines.append(f"{label} {name} over {len(r['rounds'])} rounds: {sp['min']:.2f}-{sp['max']:.2f}{flag}")
    for name, ratio in result["ratios"].items():
        line = f"{name}: decode x{ratio['decode']:.2f}, prefill x{ratio['prefill']:.2f}"
        if "decode_rounds" in ratio:
            line += "; round by round: decode " + ", ".join(f"x{v:.2f}" for v in ratio["decode_rounds"]) + \
                ", prefill " + ", ".join(f"x{v:.2f}" for v in ratio["prefill_rounds"])
        lines.append(line)
    for label, r in result["engines"].items():
        if "split" in r:
            lines.append(f"{label} decode step {split_line(r['split'])}")
        for n, s in r.get("split_by_sequences", {}).items():
            lines.append(f"{label} decode step at {n} sequences ({int(n) * 1e3 / s['step_ms']:.1f} tok/s) "
                         + split_line(s))
    return "\n".join(lines + skipped_lines(result))


def model_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options every whole-model bench takes (this one, bench/serving_bench.py): which checkpoint
    (given, or written at ``--shape`` with ``--layers`` and ``--seed``), the work directory and llama env."""
    p = Parser(description=doc.splitlines()[0] if doc else None)
    p.add_argument("--model", type=Path, help="an existing checkpoint directory (default: write one)")
    p.add_argument("--shape", default="20b", choices=("tiny", "20b"))
    p.add_argument("--layers", type=whole(1, 256), default=4)
    p.add_argument("--seed", type=whole(0, 2**32 - 1), default=0)
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK,
                   help=f"where checkpoints and GGUFs live (default {DEFAULT_WORK}; $QUANTREG_BENCH_DIR)")
    p.add_argument("--llama-env", type=Path, default=DEFAULT_LLAMA_ENV,
                   help=f"bench/llama_setup.sh's environment (default {DEFAULT_LLAMA_ENV}; $QUANTREG_LLAMA_ENV)")
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = model_parser(__doc__)
    p.add_argument("--llama-dense", default="q8_0,bf16", help="GGUF dense types, comma-separated, or 'none'")
    p.add_argument("--vllm-table", action="append", default=[], metavar="LABEL=TABLE.yaml",
                   help="add a vLLM variant served with this quantreg table (repeatable)")
    p.add_argument("--no-default-vllm", action="store_true", help="drop the table-less vLLM variant")
    p.add_argument("--vllm-env", action="append", default=[], metavar="LABEL=KEY=VALUE",
                   help="an environment variable for one vLLM variant (repeatable; e.g. an ISA-forcing one)")
    p.add_argument("--llama-build", action="append", default=[], metavar="NAME=ENV_DIR",
                   help="another llama.cpp build on the same GGUF (repeatable; QUANTREG_LLAMA_ISA=avx2 "
                        "bench/llama_setup.sh makes the AVX2 one)")
    p.add_argument("--vllm-modes", default="default,eager",
                   help="vLLM's modes to measure each variant in: default (compiled, as `vllm serve`), eager")
    p.add_argument("--threads", type=whole(1, 1024), default=2)
    p.add_argument("--split-sequences", type=whole_list(2, 1024), default=[], metavar="N,N,...",
                   help="also split eager variants' decode step with N sequences decoding together (a server's "
                        "step under N clients)")
    p.add_argument("--rounds", type=whole(1, 1000), default=3)
    p.add_argument("--decode-tokens", type=whole(1, 131072), default=128)
    p.add_argument("--prefill-tokens", type=whole(1, 131072), default=512)
    p.add_argument("--one-at-a-time", action="store_true", help="engines one after another, not alive together")
    p.add_argument("--alternate", action="store_true",
                   help="engines one at a time, restarted every round in rotated order (drift falls on all alike)")
    p.add_argument("--json", type=Path, help="where to write the result (default bench/results/wholemodel-L{N}.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    result, out = run_and_report(argv, parse, run, table, lambda r: f"wholemodel-L{r['layers']}.json")
    print(f"\n{result['duration_s']} s, load average {result['machine']['load_averages'][0]} -> "
          f"{result['machine']['load_averages'][-1]}; JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
