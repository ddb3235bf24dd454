"""``quantreg.vllm.register()``, what vLLM's plugin loader calls with no try around it: in a fresh
interpreter it survives every plugin fault (lenient) or raises one line (strict), has one boundary for
the unforeseen, keeps vLLM's stdout clean, says a left-out file is left out whole, checks the timeout
settings, and warns or refuses when its table fingerprint differs from its parent's.

Why a file apart from test_vllm_hook.py: these need no vLLM (the hook's module imports none), so they
run in the no-torch venv of the skip contract; test_vllm_hook.py is skipped without vLLM.

History (issue 24 class 5): moved from tests/test_containment_plugins.py (issue 12, plugin and start-up
classes) (classes 1, 5, 8, 9) and tests/test_hardening.py (strict vs lenient, plugin fault isolation,
security) (the fingerprint mismatch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from core_support import (
    BAD_METHODS,
    GOOD_METHODS,
    HOOK_FAULTS,
    IMPORT_FAULTS,
    PRINTER,
    PluginSite,
    add,
    child_env,
    hook_plugin,
    register_child,
    run_quantreg,
)

pytestmark = pytest.mark.usefixtures("clean_env")


# -- from test_containment_plugins.py (issue 12, plugin and start-up classes) -----------------


def all_class1_plugins(site: PluginSite) -> str:
    for kind, (source, _) in IMPORT_FAULTS.items():
        add(site, f"imp_{kind}", source)
    for kind, (body, _) in HOOK_FAULTS.items():
        add(site, f"hook_{kind}", hook_plugin(body))
    add(site, "fine", GOOD_METHODS)
    return ",".join([*(f"imp_{k}" for k in IMPORT_FAULTS), *(f"hook_{k}" for k in HOOK_FAULTS), "fine"])


def test_lenient_register_survives_every_base_exception(plugin_site: PluginSite) -> None:
    names = all_class1_plugins(plugin_site)
    out, data = register_child(plugin_site, names)
    assert out.returncode == 0 and data["raised"] is None and data["strict"] is False
    assert len(data["faults"]) == len(IMPORT_FAULTS) + len(HOOK_FAULTS), data["faults"]
    assert "good_one" in data["methods"] and "staged_then_lost" not in data["methods"]
    for kind in IMPORT_FAULTS:
        assert f"quantreg: plugin 'imp_{kind}': entry point qrt_imp_{kind} failed to import" in out.stderr
    for kind in HOOK_FAULTS:
        assert f"quantreg: plugin 'hook_{kind}', hook 'register_methods': raised" in out.stderr
    assert "left out; the other plugins and tables stay in force" in out.stderr


def test_strict_register_raises_one_line_for_every_base_exception(plugin_site: PluginSite) -> None:
    names = all_class1_plugins(plugin_site)
    out, data = register_child(plugin_site, names, QUANTREG_STRICT="1")
    assert out.returncode == 3 and data["raised"] == "QuantregError"
    assert "\n" not in data["message"] and data["message"].startswith("quantreg (strict): ")
    for name in names.split(",")[:-1]:
        assert f"plugin '{name}'" in data["message"], name


BOUNDARY = """
import json, sys
import quantreg.registry
from quantreg.problems import QuantregError
import quantreg.vllm as qv

class Unforeseen(BaseException):
    pass

def broken_fingerprint(self):  # an unforeseen fault inside quantreg itself, after the registry is built
    raise Unforeseen("fingerprint exploded")

quantreg.registry.Registry.fingerprint = broken_fingerprint
try:
    qv.register()
except QuantregError as exc:
    print(json.dumps({"raised": "QuantregError", "message": str(exc)}))
    sys.exit(3)
from quantreg.vllm.importhook import PostImportHook
armed = [f.module_name for f in sys.meta_path if isinstance(f, PostImportHook)]
qv.register()  # a second call in a process it called inactive does nothing
armed += [f.module_name for f in sys.meta_path if isinstance(f, PostImportHook)]
print(json.dumps({"raised": None, "armed": armed, "keepers": bool(qv._keepers.hooks), "inactive": qv._inactive}))
"""


@pytest.mark.vllm_installed
@pytest.mark.parametrize("strict", [False, True])
def test_register_has_one_boundary_for_the_unforeseen(strict: bool) -> None:
    """A fault no input can trigger any more (fault injection: the boundary is for what nobody foresaw)."""
    env = child_env(None, "", **({"QUANTREG_STRICT": "1"} if strict else {}))
    out = subprocess.run([sys.executable, "-c", BOUNDARY], capture_output=True, text=True, env=env, timeout=120)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert "Traceback" not in out.stderr
    if strict:
        assert out.returncode == 3 and data["message"] == (
            "quantreg (strict): register() failed unexpectedly: Unforeseen: fingerprint exploded")
    else:
        assert out.returncode == 0 and data["raised"] is None
        assert ("quantreg: register() failed unexpectedly: Unforeseen: fingerprint exploded; quantreg is inactive "
                "in this process and vLLM keeps its own MoE methods") in out.stderr
        # inactive means inactive: the fault came after the hooks were armed, and none is left (issue 46 class 1)
        assert data["armed"] == [] and data["keepers"] is False and data["inactive"] is True, data


@pytest.mark.parametrize("strict", [False, True])
def test_registrations_through_register_in_a_subprocess(plugin_site: PluginSite, strict: bool) -> None:
    regs = "\n".join(f"    register({expr})" for expr, _ in BAD_METHODS.values())
    add(plugin_site, "sloppy", f"import quantreg\n\n@quantreg.hookimpl\ndef register_methods(register):\n{regs}\n"
                               "    return 1\n")
    out, data = register_child(plugin_site, "sloppy", **({"QUANTREG_STRICT": "1"} if strict else {}))
    if strict:
        assert out.returncode == 3 and data["raised"] == "QuantregError" and "\n" not in data["message"]
        for _, expected in BAD_METHODS.values():
            assert expected in data["message"]
    else:
        assert data["raised"] is None and len(data["faults"]) == len(BAD_METHODS) + 1
        assert data["faults"][0] == ("plugin 'sloppy', hook 'register_methods': returned a value (int); "
                                      "call register(...) instead")


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("raw", ["inf", "nan", "abc"])
def test_timeout_settings_through_register_and_the_cli(raw: str, strict: bool) -> None:
    extra = {"QUANTREG_PROBE_TIMEOUT": raw, **({"QUANTREG_STRICT": "1"} if strict else {})}
    out, data = register_child(None, **extra)
    problem = raw != "inf"
    if strict and problem:
        assert out.returncode == 3 and "environment: QUANTREG_PROBE_TIMEOUT: " in data["message"]
    else:
        assert data["raised"] is None
        assert data["faults"] == ([f"environment: QUANTREG_PROBE_TIMEOUT: {raw!r} is not a positive number of "
                                   "seconds (e.g. 10, 0.5, inf); using the default 10"] if problem else [])
        if problem:
            assert "(the default is used)" in out.stderr
    answer = run_quantreg("explain", "fp8", "llama", "cpu", "--json", **extra)
    assert "Traceback" not in answer.stderr and answer.returncode == (1 if strict and problem else 0)
    assert len(json.loads(answer.stdout)["problems"]) == int(problem)


def test_register_keeps_vllms_stdout_clean_when_a_plugin_prints(plugin_site: PluginSite) -> None:
    add(plugin_site, "printer", PRINTER)
    out, data = register_child(plugin_site, "printer")
    assert out.stdout.strip().splitlines() == [json.dumps(data)]  # nothing but the child's own line
    assert "hello from import" in out.stderr and "printer_m" in data["methods"]


def test_the_lenient_warning_says_the_file_is_left_out_whole(broken_user: Path) -> None:
    out, data = register_child(None, QUANTREG_CONFIG=str(broken_user))
    assert data["raised"] is None
    assert (f"quantreg: {broken_user}:3: rules[0].method: unknown method 'nope' (registered: vllm) "
            "(this file is left out whole; the other tables stay in force)") in out.stderr
    assert "ignored; the rest of the table" not in out.stderr


# -- from test_hardening.py (strict vs lenient, fault isolation, security) --------------------


@pytest.mark.vllm_installed
def test_fingerprint_mismatch_between_processes(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        import quantreg.vllm as qv
        try:
            qv.register()
        except Exception as exc:
            print("RAISED", exc)
    """)
    base = {k: v for k, v in __import__("os").environ.items() if not k.startswith("QUANTREG_")}
    lenient = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**base, "QUANTREG_FINGERPRINT": "0123456789abcdef"})
    assert "WARNING quantreg: this process" in lenient.stderr
    assert "than its parent process (0123456789abcdef)" in lenient.stderr
    strict = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**base, "QUANTREG_FINGERPRINT": "0123456789abcdef", "QUANTREG_STRICT": "1"})
    assert strict.stdout.startswith("RAISED quantreg (strict): this process")  # strict_error: one prefix


# -- start-up budget (issue 24.7): register() does only what a decision needs ------------------------

#: Modules a vLLM process's ``register()`` must not import (with the package tables in the parse
#: cache): the kit, tune, the schema validator, the answer/findings/limitations of explain and
#: doctor (computed per key when the seam decides), the trail without QUANTREG_DECISIONS, PyYAML,
#: and torch / vLLM themselves (vLLM's MoE module is patched when vLLM imports it).
REGISTER_DENIED = ("torch", "vllm", "quantreg.testing", "quantreg.tune", "jsonschema", "yaml", "quantreg.answer",
                   "quantreg.findings", "quantreg.vllm_limits", "quantreg.audit", "quantreg.plan", "quantreg.cli",
                   # imported on use: a rule with verify:/tuned:, the first decision (host facts, Decision), the first
                   # time vLLM imports its MoE module (subclass coverage); register() itself decides nothing
                   "quantreg.table.verify", "quantreg.table.tuned", "quantreg.error_measure", "quantreg.host",
                   "quantreg.vllm.coverage", "quantreg.decision")

BUDGET_CHILD = """
import json, sys
from importlib import metadata
scans = []
full = metadata.packages_distributions
metadata.packages_distributions = lambda: scans.append(1) or full()
import quantreg.vllm as qv
from quantreg.registry import get_registry
qv.register()
print(json.dumps({"modules": sorted(sys.modules), "full_scans": len(scans), "fingerprint": get_registry().fingerprint(),
                  "tables": [t.path for t in get_registry().tables]}))
"""


@pytest.mark.vllm_installed
def test_register_imports_and_scans_only_what_a_decision_needs(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    env["QUANTREG_CACHE_DIR"] = str(tmp_path / "cache")
    runs = []
    for _ in range(2):  # the first fills the parse cache, as the first start after an install does
        out = subprocess.run([sys.executable, "-c", BUDGET_CHILD], capture_output=True, text=True, env=env,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    warm = runs[1]
    assert len(warm["tables"]) >= 1 and warm["fingerprint"] == runs[0]["fingerprint"]
    imported = [m for m in warm["modules"] if any(m == d or m.startswith(d + ".") for d in REGISTER_DENIED)]
    assert imported == []
    assert "quantreg.registry" in warm["modules"] and "pluggy" in warm["modules"]  # it did load (not vacuous)
    assert warm["full_scans"] == 0  # the fingerprint's table names read no full metadata scan
