"""Load a plugin's native library only after a child process has loaded it cleanly.

Why a child process: ``ctypes.CDLL`` runs the library's ELF constructors while holding the GIL,
so a constructor that blocks (waiting on a device, a lock, a licence server) freezes every Python
thread of the caller -- the probe-timeout thread of :func:`quantreg.methods.run_probe` included --
and one that calls ``abort()``, dereferences a bad pointer or calls ``_exit()`` ends the caller,
be it ``quantreg explain`` or vLLM's EngineCore. No thread, signal handler or ``try`` in the same
process can survive those three; a child process can. So :func:`check` loads the library in a
fresh ``python -I -S`` child, bounded by ``QUANTREG_PROBE_TIMEOUT`` (four fifths of it: the child
and anything it started are killed past that, so the verdict names the library before the probe's
own caller gives up), and reports what it found: it loaded, it exports the entry points,
its ABI function returns the expected version. Only when the child says so does :func:`load`
load it here.

What the child cannot vouch for: a constructor that behaves differently the second time (a
device that answers the child and then hangs the parent) or code that misbehaves only when
called later, not at load. The check is of *loading*.

Cost: one child (~30-60 ms) per library per process; the verdict is cached per (path, size,
modification time, what was asked), so a start-up that probes and builds a method for every
layer pays it once. A library replaced on disk is checked again.

Plugins call this (their probe and their kernel loader); core never names a plugin's library.
Never raises for a bad library: the answer is ``None`` (it loads cleanly) or one printable line.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from . import settings
from .problems import printable

_CHILD = r"""
import ctypes, json, os, sys
out = os.dup(1)
os.dup2(2, 1)  # what a constructor prints goes to stderr; the verdict has fd `out` to itself
spec = json.loads(sys.argv[1])
def say(verdict):
    os.write(out, (json.dumps(verdict) + "\n").encode())
    os._exit(0)  # no destructors, no atexit: the question was loading
try:
    for dep in spec["preload"]:
        ctypes.CDLL(dep)
    lib = ctypes.CDLL(spec["path"])
except OSError as exc:
    say({"error": " ".join(str(exc).split())})
missing = [name for name in spec["symbols"] if not hasattr(lib, name)]
abi = None
if spec["abi"] is not None and spec["abi"] not in missing:
    if not hasattr(lib, spec["abi"]):
        missing.append(spec["abi"])
    else:
        fn = getattr(lib, spec["abi"])
        fn.argtypes = []
        fn.restype = ctypes.c_int32
        abi = int(fn())
say({"missing": missing, "abi": abi})
"""

CHILD_SHARE = 0.8
"""The share of the probe timeout the child may take to load the library."""
_VERDICT_BYTES = 64 << 10
_STDERR_TAIL = 400
_lock = threading.Lock()
_verdicts: dict[tuple[object, ...], str | None] = {}


def probe_timeout() -> float:
    """Seconds a check may take: ``QUANTREG_PROBE_TIMEOUT`` (its default when unset or unreadable)."""
    return float(settings.value(settings.PROBE_TIMEOUT))


def check(path: Path | str, *, symbols: Sequence[str] = (), abi: tuple[str, int] | None = None,
          preload: Sequence[Path | str] = (), timeout: float | None = None) -> str | None:
    """``None`` when ``path`` loads cleanly in a child process, exports ``symbols`` and (``abi``
    = ``(function, version)``) its ``int32 function(void)`` returns ``version``; else why not,
    one printable line starting with the file's name. ``preload``: libraries the child loads
    first, as the caller's process will have (torch's OpenMP runtime). Cached per file identity.
    """
    where = Path(path)
    try:
        stat = where.stat()
    except OSError as exc:
        return printable(f"{where.name} unreadable ({type(exc).__name__}: {exc.strerror or exc})")
    limit = probe_timeout() if timeout is None else timeout
    key = (str(where.resolve()), stat.st_size, stat.st_mtime_ns, tuple(symbols), abi,
           tuple(str(p) for p in preload))
    with _lock:
        if key in _verdicts:
            return _verdicts[key]
        verdict = _in_child(where, symbols, abi, preload, limit)
        _verdicts[key] = verdict
        return verdict


def load(path: Path | str, *, symbols: Sequence[str] = (), abi: tuple[str, int] | None = None,
         preload: Sequence[Path | str] = (), timeout: float | None = None) -> tuple[ctypes.CDLL | None, str]:
    """``(the library, "")`` once :func:`check` passed, loaded here with fd 1 pointed at stderr
    meanwhile (a constructor's output must not land in a ``--json`` answer); else ``(None, why)``."""
    problem = check(path, symbols=symbols, abi=abi, preload=preload, timeout=timeout)
    if problem is not None:
        return None, problem
    try:
        with _stdout_to_stderr():
            return ctypes.CDLL(str(path)), ""
    except OSError as exc:  # the child loaded it; the file changed since, or this process differs
        return None, printable(f"{Path(path).name} does not load here ({' '.join(str(exc).split())})")


def _in_child(path: Path, symbols: Sequence[str], abi: tuple[str, int] | None, preload: Sequence[Path | str],
              timeout: float) -> str | None:
    name = path.name
    spec = json.dumps({"path": str(path), "symbols": list(symbols), "abi": abi[0] if abi else None,
                       "preload": [str(p) for p in preload]})
    with tempfile.TemporaryFile() as errors:
        try:
            child = subprocess.Popen([sys.executable, "-I", "-S", "-c", _CHILD, spec], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=errors, start_new_session=True)
        except OSError as exc:
            return printable(f"{name} not checked: no child process ({type(exc).__name__}: {exc})")
        # four fifths of the limit: the child's own verdict (naming the blocking library) is back before a
        # probe's caller, bounded by the same setting, gives up on the probe as a whole
        seconds = min(max(timeout * CHILD_SHARE, 0.1), 1e6)  # QUANTREG_PROBE_TIMEOUT=inf: no float overflow
        try:
            out, _ = child.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            _kill(child)
            return (f"{name} did not finish loading within {seconds:.1f}s ({settings.PROBE_TIMEOUT} {timeout:g}s): "
                    "a constructor that blocks; not loaded")
        errors.seek(0)
        said = errors.read()[-_STDERR_TAIL:].decode("utf-8", "replace").strip()
    tail = f"; it printed: {printable(said)}" if said else ""
    if child.returncode < 0:
        try:
            signame = signal.Signals(-child.returncode).name
        except ValueError:
            signame = f"signal {-child.returncode}"
        return f"{name} kills the process that loads it ({signame} while loading){tail}"
    lines = out[:_VERDICT_BYTES].decode("utf-8", "replace").splitlines()
    try:
        verdict = json.loads(lines[0]) if child.returncode == 0 and lines else None
    except ValueError:
        verdict = None
    if not isinstance(verdict, dict):
        return f"{name} ends the process that loads it (exit status {child.returncode} while loading){tail}"
    return _judge(name, verdict, abi)


def _judge(name: str, verdict: dict[str, object], abi: tuple[str, int] | None) -> str | None:
    error = verdict.get("error")
    if isinstance(error, str):
        return printable(f"{name} does not load ({error})")
    missing = verdict.get("missing")
    if isinstance(missing, list) and missing:
        return printable(f"{name} does not export {', '.join(str(m) for m in missing)}")
    version = verdict.get("abi")
    if abi is not None and version != abi[1]:
        return printable(f"{name} has ABI version {version}, this package expects {abi[1]} ({abi[0]}()): "
                         "a library from another release; reinstall it")
    return None


def _kill(child: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's session (it and anything its constructor started), then reap it."""
    with contextlib.suppress(OSError):
        os.killpg(child.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        child.communicate(timeout=5)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """fd 1 -> fd 2 for the duration (process-wide: kept to the one ``dlopen``)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:
        yield
        return
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def forget() -> None:
    """Drop the cached verdicts (tests; a process that rebuilt a library)."""
    with _lock:
        _verdicts.clear()
