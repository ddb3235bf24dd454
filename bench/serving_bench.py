"""Serving under load: vLLM + quantreg's OpenAI server against llama.cpp's ``llama-server``, many clients at once.

Issue 45. Every other figure of this project is one request at a time; an operator choosing between
vLLM + quantreg and llama.cpp on a CPU box serves a team, an agent loop or a batch job. This bench
starts each server alone on 127.0.0.1 (vLLM: ``python -m vllm.entrypoints.openai.api_server``, its
default compiled mode unless ``--vllm-eager``, through :mod:`quantreg.testing.serving`; llama.cpp:
the ``llama-server`` binary ``bench/llama_server_setup.sh`` builds from the same vendored source, with
``-np`` slots = the largest client count), sends a fixed, seeded mix of prompts (short chat-sized ones
and ``--long-tokens`` ones, ``--min-out``..``--max-out`` output tokens, as token-id prompts so both
servers see the same ids) at each client count, streaming, and reports per level:

* output tokens/s in total and requests/s (wall time of the level),
* TTFT and inter-token latency p50 / p99 (per request, from the arrival of each streamed event; an
  event carrying several tokens spreads them evenly over the gap since the previous one, as
  ``vllm bench serve`` counts per-token latency),
* errors (a request that failed, or returned fewer tokens than asked).

Loopback only, bounded: every request has a timeout and each level a fixed number of requests. The
client is this file's own (threads over ``http.client``, one connection per request), so both servers
are measured by the same code. JSON into ``bench/results/`` and a Markdown table on stdout; the host
kind (AMX / AVX-512 / AVX2) is recorded with every run.

Usage (20B width, 4 layers, both servers)::

    python -m bench.serving_bench --layers 4 --clients 1,4,16
    python -m bench.serving_bench --shape tiny --layers 2 --clients 1,2 --requests 4   # the CI smoke's size
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cli_args import model_config, whole, whole_list
from bench.common import command_line, run_and_report, skipped_lines, table_head
from bench.wholemodel_bench import model_parser  # one home for the whole-model benches' options

REQUEST_TIMEOUT = 900.0


@dataclass
class Outcome:
    """One streamed request: when each token arrived, and whether it completed."""

    asked: int
    started: float
    arrivals: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.tokens >= self.asked

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0] - self.started if self.arrivals else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


def stream_completion(port: int, model: str, prompt: list[int], max_tokens: int) -> Outcome:
    """One streamed ``/v1/completions`` request (token-id prompt, greedy, EOS ignored); each ``data:``
    event carrying text counts its tokens (vLLM: ``token_ids``; llama-server: one token per event)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, "n_predict": max_tokens}
    out = Outcome(max_tokens, time.perf_counter())
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return out
        for raw in resp:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            for choice in event.get("choices", []):
                ids = choice.get("token_ids")
                n = len(ids) if isinstance(ids, list) else (1 if choice.get("text") else 0)
                if n:  # an event may carry several tokens: spread them over the gap since the last one
                    now = time.perf_counter()
                    last = out.arrivals[-1] if out.arrivals else None
                    out.arrivals.extend([now] * n if last is None else [last + (now - last) * (k + 1) / n
                                                                        for k in range(n)])
                    out.tokens += n
    except (OSError, ValueError, http.client.HTTPException) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return out


def workload(seed: int, n: int, vocab: int, long_tokens: int, min_out: int,
             max_out: int) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, output tokens): every other one short (8-40 tokens, chat-sized), the rest long."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        length = rng.randint(8, 40) if i % 2 == 0 else long_tokens
        items.append(([rng.randrange(100, vocab - 100) for _ in range(length)], rng.randint(min_out, max_out)))
    return items


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_level(port: int, model: str, clients: int, items: list[tuple[list[int], int]]) -> dict[str, Any]:
    """All ``items`` through ``clients`` concurrent streams; the level's figures."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        outcomes = list(pool.map(lambda it: stream_completion(port, model, it[0], it[1]), items))
    wall = time.perf_counter() - t0
    done = [o for o in outcomes if o.ok]
    ttfts = [o.ttft for o in done if o.ttft is not None]
    itls = [x for o in done for x in o.itls]
    tokens = sum(o.tokens for o in outcomes)

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1e3, 1)

    return {"clients": clients, "requests": len(items), "wall_s": round(wall, 2),
            "output_tok_s": round(tokens / wall, 2), "requests_s": round(len(done) / wall, 3),
            "ttft_ms_p50": ms(percentile(ttfts, 0.5)), "ttft_ms_p99": ms(percentile(ttfts, 0.99)),
            "itl_ms_p50": ms(percentile(itls, 0.5)), "itl_ms_p99": ms(percentile(itls, 0.99)),
            "errors": [o.error or f"{o.tokens} of {o.asked} tokens" for o in outcomes if not o.ok]}


# -- the servers ---------------------------------------------------------------------------------


class VllmServer:
    label = "vLLM + quantreg"

    def __init__(self, model: Path, work: Path, threads: int, max_len: int, max_seqs: int, eager: bool,
                 table: Path | None) -> None:
        self.model, self.work, self.threads, self.max_len, self.max_seqs = model, work, threads, max_len, max_seqs
        self.eager, self.table = eager, table
        self.server: Any = None
        self.detail: dict[str, Any] = {"mode": "eager" if eager else "default", "table": str(table) if table else None}

    def start(self) -> int:
        from quantreg.testing.serving import start_server

        env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{self.threads - 1}" if self.threads > 1 else "0"}
        if self.table is not None:
            env["QUANTREG_CONFIG"] = str(self.table)
        args = ("--max-model-len", str(self.max_len), "--max-num-seqs", str(self.max_seqs))
        self.server = start_server(self.model, self.work, args, env, eager=self.eager)
        if not self.server.healthy:
            raise RuntimeError(f"vLLM did not become healthy:\n{self.server.log[-3000:]}")
        self.detail["startup_s"] = round(self.server.startup_s, 1)
        self.detail["decisions"] = sorted({ln.split("quantreg: ", 1)[1][:200] for ln in self.server.log.splitlines()
                                           if "quantreg: (" in ln and " -> " in ln})
        return int(self.server.port)

    @property
    def model_name(self) -> str:
        return str(self.model)

    def stop(self) -> None:
        from quantreg.testing.serving import stop

        if self.server is not None:
            stop(self.server.proc)


def llama_server_binary(env: Path) -> Path | None:
    found = env / "llama-server" / "bin" / "llama-server"
    return found if found.is_file() else (Path(p) if (p := shutil.which("llama-server")) else None)


class LlamaServer:
    label = "llama-server"

    def __init__(self, binary: Path, gguf: Path, work: Path, threads: int, max_len: int, slots: int) -> None:
        self.binary, self.gguf, self.work = binary, gguf, work
        self.threads, self.max_len, self.slots = threads, max_len, slots
        self.proc: subprocess.Popen[bytes] | None = None
        self.detail: dict[str, Any] = {"gguf": str(gguf), "slots": slots}

    def start(self) -> int:
        from quantreg.testing.serving import free_port

        port = free_port()
        log = open(self.work / f"llama-server-{port}.log", "wb")
        self.proc = subprocess.Popen([str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1",
                                      "--port", str(port),
                                      "-t", str(self.threads), "-np", str(self.slots),
                                      "-c", str(self.max_len * self.slots), "--cont-batching"],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 600:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {self.proc.returncode}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    self.detail["startup_s"] = round(time.perf_counter() - t0, 1)
                    return port
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError("llama-server did not become healthy in 600 s")

    @property
    def model_name(self) -> str:
        return "gguf"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)


# -- the run ---------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.common import machine
    from bench.wholemodel_bench import ensure_checkpoint, ensure_gguf

    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or ensure_checkpoint(work, args.shape, args.layers, args.seed)
    config = model_config(model, ("vocab_size",))
    levels: list[int] = args.clients
    max_len = args.long_tokens + args.max_out + 64
    servers: list[Any] = [VllmServer(model, work, args.threads, max_len, max(levels), args.vllm_eager, args.vllm_table)]
    skipped: dict[str, str] = {}
    binary = llama_server_binary(args.llama_env)
    if args.no_llama:
        skipped["llama-server"] = "--no-llama"
    elif binary is None:
        skipped["llama-server"] = (f"no llama-server under {args.llama_env} or on PATH: run "
                                   "bench/llama_server_setup.sh (it builds llama-server from the vendored llama.cpp)")
    else:
        servers.append(LlamaServer(binary, ensure_gguf(model, "q8_0", args.llama_env), work, args.threads,
                                   max_len, max(levels)))
    results: dict[str, Any] = {}
    for server in servers:  # each alone in memory
        print(f"[serving] starting {server.label}", file=sys.stderr, flush=True)
        try:
            port = server.start()
            rows = []
            for clients in levels:
                count = args.requests or args.requests_per_client * clients
                items = workload(args.seed + clients, count, int(config["vocab_size"]), args.long_tokens, args.min_out,
                                 args.max_out)
                print(f"[serving] {server.label}: {clients} clients, {len(items)} requests", file=sys.stderr,
                      flush=True)
                rows.append(run_level(port, server.model_name, clients, items))
            results[server.label] = {**server.detail, "levels": rows}
        except Exception as exc:  # one server failing costs its rows, not the other's
            skipped[server.label] = f"failed: {exc}"
        finally:
            server.stop()
    ratios = {}
    if "llama-server" in results and "vLLM + quantreg" in results:
        for a, b in zip(results["vLLM + quantreg"]["levels"], results["llama-server"]["levels"]):
            ratios[str(a["clients"])] = round(a["output_tok_s"] / b["output_tok_s"], 3) if b["output_tok_s"] else None
    return {"shape": args.shape, "layers": int(config["num_hidden_layers"]), "threads": args.threads,
            "machine": machine(), "servers": results, "skipped": skipped,
            "throughput_ratio_vllm_over_llama": ratios,
            "settings": {k: str(v) for k, v in vars(args).items()},
            "command": command_line("bench.serving_bench")}


def table(result: dict[str, Any]) -> str:
    lines = table_head(f"Serving, GPT-OSS ({result['shape']} shape), {result['layers']} layers, "
                       f"{result['threads']} threads, host kind {result['machine']['host_kind']}",
                       ["server", "clients", "out tok/s", "req/s", "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "errors"])
    for label, r in result["servers"].items():
        for lv in r["levels"]:
            lines.append(f"| {label} | {lv['clients']} | {lv['output_tok_s']:.1f} | {lv['requests_s']:.2f} | "
                         f"{lv['ttft_ms_p50']} / {lv['ttft_ms_p99']} | {lv['itl_ms_p50']} / {lv['itl_ms_p99']} | "
                         f"{len(lv['errors'])} |")
    for clients, ratio in result["throughput_ratio_vllm_over_llama"].items():
        lines.append(f"{clients} clients: vLLM + quantreg / llama-server output tok/s x{ratio}")
    return "\n".join(lines + skipped_lines(result))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = model_parser(__doc__)
    p.add_argument("--no-llama", action="store_true", help="measure vLLM + quantreg only")
    p.add_argument("--vllm-eager", action="store_true", help="vLLM with --enforce-eager (default: its compiled mode)")
    p.add_argument("--vllm-table", type=Path, help="QUANTREG_CONFIG for the vLLM server (e.g. tune's table)")
    p.add_argument("--threads", type=whole(1, 1024), default=2)
    p.add_argument("--clients", type=whole_list(1, 1024), default=[1, 4, 16],
                   help="concurrent client counts, comma-separated")
    p.add_argument("--requests", type=whole(0, 1_000_000), default=0,
                   help="requests per level (default: --requests-per-client x clients)")
    p.add_argument("--requests-per-client", type=whole(1, 100_000), default=4,
                   help="each client's requests per level when --requests is not given (24 layers: 2 keeps a run "
                        "near an hour on 2 cores)")
    p.add_argument("--long-tokens", type=whole(1, 131072), default=512)
    p.add_argument("--min-out", type=whole(1, 131072), default=64)
    p.add_argument("--max-out", type=whole(1, 131072), default=256)
    p.add_argument("--json", type=Path, help="where to write the result")
    args = p.parse_args(argv)
    if args.max_out < args.min_out:
        p.error(f"argument --max-out: {args.max_out} is below --min-out {args.min_out}")
    return args


def main(argv: list[str] | None = None) -> int:
    _, out = run_and_report(argv, parse, run, table,
                            lambda r: f"serving-L{r['layers']}-{r['machine']['host_kind']}.json")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
