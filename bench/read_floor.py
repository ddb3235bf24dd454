"""The read floor the CPU MXFP4 bench compares the kernel with, built by the bench itself.

Why here and not in the plugin: a bench helper has no place in the production library. The C file
(:file:`read_floor.c`) is compiled once per host into ``~/.cache/quantreg-bench`` with the same
compiler the plugin's build uses (``$CC`` or ``cc``, ``-O2 -mavx2 -fopenmp``) and loaded with
ctypes after torch, so it shares torch's OpenMP threads like the kernel does.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("read_floor.c")
CHUNK = 256 << 10


@cache
def _library() -> ctypes.CDLL:
    text = SOURCE.read_bytes()
    cache_dir = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quantreg-bench"
    cache_dir.mkdir(parents=True, exist_ok=True)
    lib = cache_dir / f"read_floor-{hashlib.sha256(text).hexdigest()[:12]}.so"
    if not lib.exists():
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-mavx2", "-fopenmp", "-shared", "-fPIC", "-o", str(tmp),
                        str(SOURCE)], check=True)
        tmp.replace(lib)
    handle = ctypes.CDLL(str(lib))
    handle.read_pass.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    handle.read_pass.restype = ctypes.c_uint64
    return handle


def read_pass(tensors: list[torch.Tensor]) -> int:
    """One threaded read pass over the tensors' bytes (contiguous CPU tensors); returns their XOR."""
    ptrs: list[int] = []
    lens: list[int] = []
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("read_pass needs contiguous CPU tensors")
        base, size = t.data_ptr(), t.numel() * t.element_size()
        for start in range(0, size, CHUNK):
            ptrs.append(base + start)
            lens.append(min(CHUNK, size - start))
    n = len(ptrs)
    c_ptrs = (ctypes.c_void_p * n)(*ptrs)
    c_lens = (ctypes.c_int64 * n)(*lens)
    return int(_library().read_pass(c_ptrs, c_lens, n, torch.get_num_threads()))
