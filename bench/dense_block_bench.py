"""Plugin #3's block-scaled int8 kernel (issue 54) against its old per-token kernel and the read floor.

``cpu_int8_dense_kernel`` now rounds weights and activations per 32-block along K (llama.cpp's Q8_0
scheme) where it rounded weights per output row and activations per token. The block scales cost
bytes (fp16 per 32 weights: +6.25 %, what Q8_0's GGUF blocks carry too) and an fp32 FMA per block;
this bench says what that costs at decode (1 token) and prefill, in one process, interleaved:

* ``block-avx512`` / ``block-avx2``: the installed kernel (:func:`quantreg_cpu_int8_dense.kernel.linear`)
  on each ISA path (AVX2 forced with ``QUANTREG_CPU_INT8_DENSE_ISA``);
* ``pertoken-avx512`` / ``pertoken-avx2``: the per-token kernel as it was at ``--old-rev`` (its C
  sources taken from git, compiled here with setup.py's flags into ``~/.cache/quantreg-bench``,
  loaded with ctypes through its ABI 1) -- a bench-only build, offered by no table;
* the read floor: each kernel's bytes per call over this machine's read bandwidth
  (``bench/read_floor.py``, the fastest of 5 passes over 1 GiB).

At 1 token every method cycles through enough copies of its weight to exceed the last-level cache.
``--rounds`` (>= 3) interleaved rounds, each the median of ``--reps`` calls; the JSON holds every round,
the median and the spread (max/min). The JSON also holds each kernel's rms error against float64 on
Gaussian activations and with two channels at 100x the rest (the kit's heavy-tailed case).
The machine is shared (other agents run builds and tests): ``uptime`` before and after is in the JSON.

    python bench/dense_block_bench.py [--rounds 3] [--json bench/results/dense_block.json]
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cli_args import Parser, whole, whole_list
from bench.dense_int8_bench import median_ms
from bench.dense_kernel_bench import LLC_BYTES, SPREAD_FLAG, Cycle, _uptime, read_bandwidth

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"attention qkv_proj": (2880, 5120), "attention o_proj": (4096, 2880), "lm_head": (2880, 201088)}
OLD_REV = "e7572fe"
"""The last commit with the per-token kernel (ABI 1)."""
CSRC = ("csrc/int8_dense.h", "csrc/dense.cpp", "csrc/gemv_avx2.cpp", "csrc/gemv_avx512.cpp")
FLAGS = ["-std=c++17", "-O3", "-g0", "-fopenmp", "-fvisibility=hidden", "-w", "-shared", "-fPIC"]


class _OldArgs(ctypes.Structure):
    """ABI 1's ``Args`` (per-token kernel)."""

    _fields_ = [
        ("x", ctypes.c_void_p), ("x_dtype", ctypes.c_int32), ("m", ctypes.c_int64), ("k", ctypes.c_int64),
        ("packed", ctypes.c_void_p), ("rowsum", ctypes.c_void_p), ("wscale", ctypes.c_void_p),
        ("n", ctypes.c_int64), ("kp", ctypes.c_int64),
        ("bias", ctypes.c_void_p), ("bias_dtype", ctypes.c_int32),
        ("out", ctypes.c_void_p), ("out_dtype", ctypes.c_int32),
        ("isa", ctypes.c_int32), ("threads", ctypes.c_int32),
    ]


@functools.cache
def old_library(rev: str) -> ctypes.CDLL:
    """The per-token kernel of ``rev``, compiled once per source hash (loaded after torch: one libgomp)."""
    import torch  # noqa: F401  (libgomp first)

    texts = {name: subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:plugins/cpu_int8_dense/{name}"],
                                  check=True, capture_output=True).stdout for name in CSRC}
    digest = hashlib.sha256(b"".join(texts[n] for n in CSRC)).hexdigest()[:12]
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quantreg-bench"
    cache = base / f"int8-pertoken-{digest}"
    lib = cache / "lib.so"
    if not lib.exists():
        (cache / "csrc").mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            (cache / name).write_bytes(text)
        tmp = cache / f"lib.{os.getpid()}.tmp"
        subprocess.run([os.environ.get("CXX", "g++"), *FLAGS, "-o", str(tmp),
                        *[str(cache / n) for n in CSRC if n.endswith(".cpp")]], check=True)
        tmp.replace(lib)
    handle = ctypes.CDLL(str(lib))
    handle.qr8_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64]
    handle.qr8_linear.argtypes = [ctypes.POINTER(_OldArgs), ctypes.c_char_p, ctypes.c_int64]
    return handle


class OldPacked:
    """One weight in the per-token kernel's layout (per-channel int8, 16-row interleave, row sums)."""

    def __init__(self, w: Any, rev: str) -> None:
        import torch
        from quantreg_cpu_int8_dense.quantize import quantize_per_channel

        self.lib = old_library(rev)
        q, self.scale = quantize_per_channel(w)
        self.n, self.k = int(q.shape[0]), int(q.shape[1])
        self.kp = (self.k + 15) // 16 * 16
        np_ = (self.n + 15) // 16 * 16
        self.packed = torch.empty(np_ * self.kp, dtype=torch.int8)
        self.rowsum = torch.empty(np_, dtype=torch.int32)
        err = ctypes.create_string_buffer(256)
        if self.lib.qr8_pack(q.data_ptr(), self.n, self.k, self.kp, self.packed.data_ptr(), self.rowsum.data_ptr(),
                             err, len(err)) != 0:
            raise RuntimeError(err.value.decode())
        self.nbytes = self.packed.numel() + self.rowsum.numel() * 4 + self.scale.numel() * 4

    def __call__(self, x: Any, isa: str) -> Any:
        import torch

        x = x.contiguous()
        out = torch.empty((x.shape[0], self.n), dtype=x.dtype)
        args = _OldArgs(x=x.data_ptr(), x_dtype=1 if x.dtype == torch.bfloat16 else 0, m=x.shape[0], k=self.k,
                        packed=self.packed.data_ptr(), rowsum=self.rowsum.data_ptr(), wscale=self.scale.data_ptr(),
                        n=self.n, kp=self.kp, bias=None, bias_dtype=0, out=out.data_ptr(),
                        out_dtype=1 if out.dtype == torch.bfloat16 else 0, isa=1 if isa == "avx512" else 0,
                        threads=torch.get_num_threads())
        err = ctypes.create_string_buffer(256)
        if self.lib.qr8_linear(ctypes.byref(args), err, len(err)) != 0:
            raise RuntimeError(err.value.decode())
        return out


def build(name: str, w: Any, copies: int, rev: str) -> tuple[Callable[[Any], Cycle], int, Callable[[Any], Any]]:
    """(x -> a call cycling over ``copies`` copies of the weight, bytes per call, x -> one output)."""
    from quantreg_cpu_int8_dense import kernel

    scheme, isa = name.split("-")

    def forced(fn: Callable[[], Any]) -> Any:
        os.environ["QUANTREG_CPU_INT8_DENSE_ISA"] = isa
        return fn()

    if scheme == "block":
        packs: list[Any] = [kernel.PackedWeight.from_weight(w) for _ in range(copies)]
        one = functools.partial(kernel.linear)
        return ((lambda x: Cycle([functools.partial(forced, functools.partial(one, x, pw)) for pw in packs])),
                packs[0].nbytes, lambda x: forced(functools.partial(one, x, packs[0])))
    olds = [OldPacked(w, rev) for _ in range(copies)]
    return ((lambda x: Cycle([functools.partial(p, x, isa) for p in olds])), olds[0].nbytes,
            lambda x: olds[0](x, isa))


def rms_errors(one: Callable[[Any], Any], w: Any) -> dict[str, float]:
    """rms error against float64 at 16 tokens: Gaussian, and two channels at 100x on 1 token in 4."""
    from quantreg.testing.heavy_tail import CASES, heavy_tailed, rms

    out = {}
    for case in (CASES[0], CASES[2]):
        x = heavy_tailed(16, w.shape[1], case, seed=54)
        out[case.name] = rms(one(x), x.double() @ w.double().t())
    return out


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=whole(3, 1000), default=3)
    parser.add_argument("--reps", type=whole(1, 100_000), default=7)
    parser.add_argument("--tokens", type=whole_list(1, 65536), default=[1, 512])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--old-rev", default=OLD_REV)
    parser.add_argument("--threads", type=whole(0, 4096), default=0,
                        help="torch threads (0: torch's default); 1 on a loaded host keeps a descheduled second "
                             "thread from stalling every call")
    parser.add_argument("--json")
    args = parser.parse_args()
    import torch
    from quantreg_cpu_int8_dense import kernel

    from quantreg.host import host_facts

    if args.threads:
        torch.set_num_threads(args.threads)
    up_before, load_before = _uptime(), os.getloadavg()
    bandwidth = read_bandwidth()
    facts = host_facts()
    has_vnni = kernel.status()[0] and kernel.isa() == "avx512"
    methods = (["block-avx512", "pertoken-avx512"] if has_vnni else []) + ["block-avx2", "pertoken-avx2"]
    print(f"host {facts.kind} ({', '.join(facts.notable_flags)}), {torch.get_num_threads()} threads, "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s; {up_before}", flush=True)
    torch.manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        k, n = SHAPES[shape]
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        for m in args.tokens:
            if shape == "lm_head" and m > 1:
                continue
            x = torch.randn(m, k).to(torch.bfloat16)
            calls: dict[str, Cycle] = {}
            nbytes: dict[str, int] = {}
            errors: dict[str, dict[str, float]] = {}
            for name in methods:
                copies = max(1, min(16, LLC_BYTES // (n * k) + 1)) if m == 1 else 1
                make, nbytes[name], one = build(name, w, copies, args.old_rev)
                calls[name] = make(x)
                if m == 1:
                    with torch.inference_mode():
                        errors[name] = rms_errors(one, w)
            per_round: dict[str, list[float]] = {name: [] for name in calls}
            reps = max(3, args.reps if m == 1 else args.reps // 2)
            with torch.inference_mode():
                for _ in range(args.rounds):  # interleaved
                    for name, call in calls.items():
                        call()
                        per_round[name].append(median_ms(call, reps))
            for name, times in per_round.items():
                med = statistics.median(times)
                spread = max(times) / min(times)
                floor_ms = nbytes[name] / bandwidth * 1e3
                row = {"layer": shape, "K": k, "N": n, "tokens": m, "method": name, "ms": round(med, 4),
                       "rounds_ms": [round(t, 4) for t in times], "spread": round(spread, 3),
                       "spread_flag": spread > SPREAD_FLAG, "bytes_per_call": nbytes[name],
                       "read_floor_ms": round(floor_ms, 4), "x_read_floor": round(med / floor_ms, 3),
                       "gbps": round(nbytes[name] / med / 1e6, 2)}
                if name in errors:
                    row["rms_error_vs_float64"] = errors[name]
                rows.append(row)
                print(f"{shape:20s} {k:5d}->{n:6d} tokens {m:4d} {name:16s} {med:9.3f} ms  floor {floor_ms:8.3f} ms "
                      f"x{row['x_read_floor']:5.2f}  {row['gbps']:6.2f} GB/s  spread {spread:4.2f}"
                      f"{' FLAGGED' if row['spread_flag'] else ''}  {errors.get(name, '')}", flush=True)
            del calls
    out = {"bench": "dense_block", "issue": 54, "host_kind": facts.kind, "cpu_flags": facts.notable_flags,
           "cpu_model": facts.model_name, "simulated_flags": facts.simulated, "threads": torch.get_num_threads(),
           "read_bandwidth_gbps": round(bandwidth / 1e9, 2), "uptime_before": up_before, "uptime_after": _uptime(),
           "load_average_before": load_before, "load_average_after": os.getloadavg(), "rounds": args.rounds,
           "old_rev": args.old_rev, "spread_flag_above": SPREAD_FLAG,
           "note": ("host shared with other agents' builds and tests while this ran (see the load averages): "
                    "times are upper bounds; compare methods within a round. read floor = the method's bytes per "
                    "call / read bandwidth. pertoken-* is the per-token kernel of old_rev, built for this bench "
                    "only"),
           "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
