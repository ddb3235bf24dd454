"""Shared helpers and fixtures for the core tests: real files on disk, real entry points, a clean environment.

Plugins are real distributions: :class:`PluginSite` writes ``<dist>-0.1.dist-info/METADATA`` and
``entry_points.txt`` (group ``quantreg``) plus the plugin modules into a temp directory and puts
that directory on ``sys.path``, so :mod:`importlib.metadata` discovers them like installed
packages. Nothing here patches :mod:`importlib.metadata`.

Fixtures are opt-in (``pytestmark = pytest.mark.usefixtures("clean_env")``) so that tests other
teams keep in ``tests/`` (``e2e/``, ``test_vllm_hook.py``) see the environment untouched.

The host's kind of CPU, the skip policy and plugin #1's reference availability live in
environment_support.py; every one of their names is re-exported here, so ``from core_support
import ...`` keeps working for all of them.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from environment_support import _ABSENT as _ABSENT
from environment_support import _HOST_KIND as _HOST_KIND
from environment_support import _NOT_IMPORTED as _NOT_IMPORTED
from environment_support import FULL_ENV as FULL_ENV
from environment_support import HOST_KINDS as HOST_KINDS
from environment_support import REFERENCE as REFERENCE
from environment_support import REFERENCE_RUNS as REFERENCE_RUNS
from environment_support import HostKind as HostKind
from environment_support import SkipPolicy as SkipPolicy
from environment_support import _skip_reason as _skip_reason
from environment_support import host_kind as host_kind
from environment_support import importable as importable
from environment_support import skip_verdict as skip_verdict

import quantreg
from quantreg import Registry
from quantreg.registry import set_registry

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
BAD_TABLES = TESTS / "bad_tables"
GOOD_TABLES = TESTS / "good_tables"
#: The real console script of the venv running the tests.
QUANTREG = Path(sys.executable).with_name("quantreg")
QUANTREG_VARS = ("QUANTREG_CONFIG", "QUANTREG_PLUGINS", "QUANTREG_DISABLE_PLUGINS", "QUANTREG_STRICT")
#: Prefix of every module the throwaway plugins define; they are dropped from sys.modules after each test.
MODULE_PREFIX = "qrt_"
#: The head of a child script that builds vLLM layers through quantreg's dense seam in one process:
#: quantreg's log records kept in ``records``, the names such a child uses, and ``one_rank(config)``
#: (vLLM's parallel groups of one rank under ``config``, entered for the rest of the child's life).
DENSE_CHILD_HEAD = """
import json, logging, socket, sys
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append((record.levelname, record.getMessage()))
logging.getLogger("vllm.quantreg").addHandler(Keep())
logging.getLogger("vllm.quantreg").setLevel(logging.INFO)
from quantreg.problems import QuantregError
from quantreg.registry import Registry, set_registry
from quantreg.vllm.dense import DenseSeam
from quantreg.vllm.seam import Seam
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
def one_rank(config):
    global vllm_config_scope  # held: a context manager nobody holds is closed, and the config unset with it
    vllm_config_scope = set_current_vllm_config(config)
    vllm_config_scope.__enter__()
    sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)
"""


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No QUANTREG_* variable from the caller's shell, and no process-wide registry left over."""
    for var in QUANTREG_VARS:
        monkeypatch.delenv(var, raising=False)
    set_registry(None)
    yield
    set_registry(None)


@pytest.fixture
def vllm_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hide an already imported vLLM for one test (e.g. ``pytest.importorskip("vllm")`` elsewhere).

    Tests of the vLLM-free behaviour (plain classes, no base passed to ``Method.load()``) run as
    on a host without vLLM, whatever an earlier test imported.
    """
    monkeypatch.delitem(sys.modules, "vllm", raising=False)


def write(path: Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` (parents made): text dedented and stripped of its leading newlines,
    bytes as they are (for tables whose bytes are the fault)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else textwrap.dedent(data).lstrip("\n").encode())
    return path


@pytest.fixture
def table(tmp_path: Path) -> Callable[[str, str], Path]:
    """``table("user.yaml", yaml_text)`` writes a (dedented) table under tmp_path and returns its path."""

    def make(name: str, text: str) -> Path:
        return write(tmp_path / "tables" / name, text)

    return make


class PluginSite:
    """A directory of throwaway distributions, on ``sys.path`` for this test."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def add(
        self,
        dist: str,
        entry_points: Mapping[str, str],
        modules: Mapping[str, str] = {},
        files: Mapping[str, str] = {},
    ) -> None:
        """One distribution ``dist`` 0.1 with ``entry_points`` in group ``quantreg``.

        ``modules`` maps module names (``qrt_...``) to source; ``files`` maps relative paths
        (e.g. tables next to the module) to text.
        """
        for name in modules:
            assert name.split(".")[0].startswith(MODULE_PREFIX), name
        info = self.root / f"{dist.replace('-', '_')}-0.1.dist-info"
        write(info / "METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
        write(info / "entry_points.txt", f"[quantreg]\n{lines}")
        for name, source in modules.items():
            write(self.root / (name.replace(".", "/") + ".py"), source)
        for rel, text in files.items():
            write(self.root / rel, text)
        importlib.invalidate_caches()

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a subprocess that should see these distributions."""
        env = {k: v for k, v in os.environ.items() if k not in QUANTREG_VARS}
        env["PYTHONPATH"] = os.pathsep.join([str(self.root), *filter(None, [env.get("PYTHONPATH")])])
        env.update(extra)
        return env


def _forget_test_modules() -> None:
    for name in [m for m in sys.modules if m.startswith(MODULE_PREFIX)]:
        del sys.modules[name]


@pytest.fixture
def plugin_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginSite]:
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    _forget_test_modules()
    yield PluginSite(root)
    _forget_test_modules()
    importlib.invalidate_caches()


@pytest.fixture
def module_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str], Path]]:
    """``module_dir("qrt_x", source)`` writes an importable module (not a distribution)."""
    root = tmp_path / "modules"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    _forget_test_modules()

    def make(name: str, source: str) -> Path:
        assert name.startswith(MODULE_PREFIX), name
        path = write(root / (name.replace(".", "/") + ".py"), source)
        importlib.invalidate_caches()
        return path

    yield make
    _forget_test_modules()


def run_cli(*args: str, env: Mapping[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real ``quantreg`` console script; by default no installed plugin is loaded."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if k not in QUANTREG_VARS}
        env["QUANTREG_PLUGINS"] = ""
    return subprocess.run([str(QUANTREG), *args], capture_output=True, text=True, env=dict(env), cwd=cwd,
                          timeout=120)


#: A lenient (or strict) vLLM start-up in miniature: what vLLM's plugin loader does, with no try around
#: it, then what the registry holds; exit 3 if it raised (the one error vLLM would print).
REGISTER_CODE = """
import json, sys
import quantreg.vllm as qv
from quantreg.registry import get_registry
try:
    qv.register()
except BaseException as exc:
    print(json.dumps({"raised": type(exc).__name__, "message": str(exc)}))
    sys.exit(3)
registry = get_registry()
print(json.dumps({"raised": None, "problems": [str(p) for p in registry.problems],
                  "faults": [str(f) for f in registry.faults], "methods": sorted(registry.methods),
                  "tables": [t.path for t in registry.tables], "strict": registry.strict}))
"""


def run_register(config: list[str] | str = (), timeout: float = 120, **extra: str) -> subprocess.CompletedProcess[str]:
    """``quantreg.vllm.register()`` in a fresh interpreter with ``QUANTREG_CONFIG`` naming ``config``.

    The child prints one JSON line (problems, tables kept, mode) or, if ``register()`` raised, the
    exception; a traceback or a hang is the failure these tests look for.
    """
    env = {k: v for k, v in os.environ.items() if k not in QUANTREG_VARS}
    env["QUANTREG_PLUGINS"] = ""
    env["QUANTREG_CONFIG"] = config if isinstance(config, str) else os.pathsep.join(config)
    env.update(extra)
    return subprocess.run([sys.executable, "-c", REGISTER_CODE], capture_output=True, text=True, env=env,
                          timeout=timeout)


def installed_copy(root: Path, source: Path, modules: tuple[str, ...], dist: str, entry_points: str) -> Path:
    """Copy a plugin's ``modules`` from ``source`` into ``root`` beside a ``dist`` 0.1 dist-info whose
    ``[quantreg]`` group holds ``entry_points``: one sys.path entry that real vLLM subprocesses see
    as an installed distribution (e2e tests put ``root`` on their PYTHONPATH)."""
    for name in modules:
        shutil.copy(source / name, root / name)
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[quantreg]\n{entry_points}\n")
    return root


def faults(registry: Registry) -> list[str]:
    """Every fault of ``registry`` (table problems, then plugin failures), as the CLI prints them."""
    return [str(f) for f in registry.faults]


def plugin_failures(registry: Registry) -> list[str]:
    """Only the plugin failures of ``registry`` (what a plugin's hooks got wrong)."""
    return [str(f) for f in registry.failures]


# -- helpers for tests that check faults are contained (plugins built from source, register() in a
# fresh interpreter, the real console script): moved from test_containment_*.py and test_hardening.py,
# which now live by module (issue 24 class 5) and share these. -----------------------------------------
# -- from test_containment_loader.py (issue 12, loader classes) -------------------------------


def _bench_module() -> Any:
    """bench/registry_bench.py by path: the tests and the bench build the same pathological tables,
    and ``bench`` is not importable from every working directory the suite runs in."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:  # registry_bench imports bench.common
        sys.path.insert(0, str(root))
    path = root / "bench" / "registry_bench.py"
    spec = importlib.util.spec_from_file_location("quantreg_bench_registry", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- from test_containment_plugins.py (issue 12, plugin and start-up classes) -----------------


def add(site: PluginSite, name: str, source: str, **files: str) -> None:
    """Distribution ``qrt-<name>`` with entry point ``<name> = qrt_<name>`` and that module source."""
    site.add(f"qrt-{name}", {name: f"qrt_{name}"}, modules={f"qrt_{name}": textwrap.dedent(source)}, files=files)


def child_env(site: PluginSite | None, plugins: str, **extra: str) -> dict[str, str]:
    env = site.env() if site is not None else {k: v for k, v in os.environ.items() if k not in QUANTREG_VARS}
    env["QUANTREG_PLUGINS"] = plugins
    env.update(extra)
    return env


def register_child(site: PluginSite | None, plugins: str = "", timeout: float = 120,
                   **extra: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``register()`` in a fresh interpreter; the JSON line it printed (a missing line is a failure)."""
    out = subprocess.run([sys.executable, "-c", REGISTER_CODE], capture_output=True, text=True,
                         env=child_env(site, plugins, **extra), timeout=timeout)
    lines = out.stdout.strip().splitlines()
    assert lines, f"register() ended the process (rc {out.returncode}) without a word:\n{out.stderr[-2000:]}"
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return out, json.loads(lines[-1])


def run_quantreg(*args: str, site: PluginSite | None = None, plugins: str = "",
                 **extra: str) -> subprocess.CompletedProcess[str]:
    """The real ``quantreg`` console script with ``site``'s plugins (``QUANTREG_PLUGINS=plugins``) and ``extra``."""
    return subprocess.run([str(QUANTREG), *args], capture_output=True, text=True,
                          env=child_env(site, plugins, **extra), timeout=120)


GOOD_METHODS = """
import quantreg

@quantreg.hookimpl
def register_methods(register):
    register(quantreg.Method(name="good_one", target="qrt_nowhere:Impl"))
"""


IMPORT_FAULTS = {
    "exit0": ("import sys\nsys.exit(0)\n", "failed to import: SystemExit: 0"),
    "exit_text": ("raise SystemExit('bye')\n", "failed to import: SystemExit: bye"),
    "custom_base": ("class Stop(BaseException):\n    pass\nraise Stop('halt')\n", "failed to import: Stop: halt"),
    "bad_str": ("class Odd(Exception):\n    def __str__(self):\n        raise RuntimeError('no text')\nraise Odd()\n",
                "failed to import: Odd: <its message could not be read>"),
    "generator_exit": ("raise GeneratorExit('gone')\n", "failed to import: GeneratorExit: gone"),
}


HOOK_FAULTS = {
    "system_exit": ("raise SystemExit(3)", "raised SystemExit: 3"),
    "custom_base": ("raise Halt('stop here')", "raised Halt: stop here"),
    "bad_str": ("raise BadStr()", "raised BadStr: <its message could not be read>"),
    "exit_call": ("import sys; sys.exit(0)", "raised SystemExit: 0"),
}


HOOK_PRELUDE = """
import quantreg

class Halt(BaseException):
    pass

class BadStr(Exception):
    def __str__(self):
        raise ValueError("unprintable")
"""


def hook_plugin(body: str) -> str:
    return HOOK_PRELUDE + f"""
@quantreg.hookimpl
def register_methods(register):
    register(quantreg.Method(name="staged_then_lost", target="qrt_nowhere:Impl"))
    {body}
"""


BAD_METHODS = {
    "name=None": ("quantreg.Method(name=None, target='qrt_x:Y')",
                  "method name None is not valid (letters, digits, '_', '.', '-')"),
    "target=None": ("quantreg.Method(name='m', target=None)",
                    "method 'm': target None is not of the form 'package.module:Class'"),
    "target extra colon": ("quantreg.Method(name='m', target='pkg:Cls:Extra')",
                           "method 'm': target 'pkg:Cls:Extra' is not of the form 'package.module:Class'"),
    "devices=None": ("quantreg.Method(name='m', target='qrt_x:Y', devices=None)",
                     "method 'm': devices must be a tuple of device names such as ('hpu',), got NoneType None"),
    "devices str": ("quantreg.Method(name='m', target='qrt_x:Y', devices='hpu')",
                    "method 'm': devices must be a tuple of device names such as ('hpu',), got str 'hpu'"),
    "devices item": ("quantreg.Method(name='m', target='qrt_x:Y', devices=('hpu', 3))",
                     "method 'm': devices holds 3, which is not one of the device names"),
    "requires str": ("quantreg.Method(name='m', target='qrt_x:Y', requires='torch')",
                     "method 'm': requires must be a tuple of module names such as ('my_runtime',), got str 'torch'"),
    "requires item": ("quantreg.Method(name='m', target='qrt_x:Y', requires=('torch', 'not a module'))",
                      "method 'm': requires holds 'not a module', which is not one of the module names"),
    "options str": ("quantreg.Method(name='m', target='qrt_x:Y', options='chunk')",
                    "method 'm': options must be a tuple of option names such as ('chunk',), got str 'chunk'"),
    "options item": ("quantreg.Method(name='m', target='qrt_x:Y', options=(None,))",
                     "method 'm': options holds None, which is not one of the option names"),
    "vllm_version int": ("quantreg.Method(name='m', target='qrt_x:Y', vllm_version=30)",
                         "method 'm': vllm_version must be a string such as '>=0.30,<0.40' or None, got int"),
    "probe int": ("quantreg.Method(name='m', target='qrt_x:Y', probe=42)",
                  "method 'm': probe must be a callable or 'package.module:function', got 42"),
    "probe bad target": ("quantreg.Method(name='m', target='qrt_x:Y', probe='no colon')",
                         "method 'm': probe must be a callable or 'package.module:function', got 'no colon'"),
    "description": ("quantreg.Method(name='m', target='qrt_x:Y', description=None)",
                    "method 'm': description must be a string, got NoneType"),
    "numerics": ("quantreg.Method(name='m', target='qrt_x:Y', numerics=32)",
                 "method 'm': numerics must be a string, got int"),
}


class _Registers:
    """A plugin object (Plugins.add) registering the given items and returning ``returns``."""

    def __init__(self, *items: Any, returns: Any = None) -> None:
        self.items, self.returns = items, returns

    @quantreg.hookimpl
    def register_methods(self, register: Any) -> Any:
        for item in self.items:
            register(item)
        return self.returns


@pytest.fixture
def broken_user(tmp_path: Path) -> Path:
    return write(tmp_path / "broken.yaml", "version: 1\nrules:\n  - {match: {device: cpu}, method: nope}\n")


PRINTER = """
import quantreg
print("hello from import")

def probe():
    print("hello from the probe")
    return True, "fine"

@quantreg.hookimpl
def register_methods(register):
    print("hello from the hook")
    register(quantreg.Method(name="printer_m", target="qrt_x:Y", probe="qrt_printer:probe"))
"""


# -- from test_hardening.py (strict vs lenient, fault isolation, security) --------------------


GOOD_RULES = "version: 1\nrules:\n  - match: {quant_format: fmt}\n    method: good\n"
