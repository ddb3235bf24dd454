"""``quantreg tune`` writes one rule for decode and prefill where the curves cross (issue 32, item 3).

Real vLLM layers at the tiny shape (the kit's harness, in the tune process), with a throwaway
plugin installed as a real distribution (tests/e2e/tune_plugin/quantreg_tune_crossover.py): each
method is ``mxfp4_reference`` plus a sleep that puts its curve where the test knows it is.
Entry point ``crossing``: ``tune_decode`` (20 ms up to 8 tokens, 400 ms above) against
``tune_prefill`` (200 ms flat): faster up to 8 tokens, slower from 16 on, so the crossover is 8.
Entry point ``parallel``: ``tune_flat`` (100 ms flat) is faster than ``tune_prefill`` everywhere.
Every other method is kept out (plugins #1, #2 and the dense plugin disabled; vLLM's own kernel
believed absent through the host-facts seam) so the curves decide alone.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import QUANTREG, installed_copy

from quantreg.host import simulate

pytest.importorskip("quantreg_hpu_mxfp4", reason="plugin #1 (plugins/hpu_mxfp4) is not installed")

HERE = Path(__file__).resolve().parent
KEY = {"quant_format": "gpt_oss_mxfp4", "model_type": "gpt_oss", "device": "cpu"}
COUNTS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return installed_copy(tmp_path_factory.mktemp("tune-crossover-site"), HERE / "tune_plugin",
                          ("quantreg_tune_crossover.py", "quantreg_tune_crossing.py", "quantreg_tune_parallel.py"),
                          "quantreg-tune-crossover",
                          "crossing = quantreg_tune_crossing\nparallel = quantreg_tune_parallel")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quantreg.tiny.checkpoint import write_tiny_gpt_oss

    return write_tiny_gpt_oss(tmp_path_factory.mktemp("tune-crossover") / "model")


def site_env(site: Path, disabled: str) -> dict[str, str]:
    """Only the curved methods of the entry point not ``disabled`` can be measured (or named by a table)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["QUANTREG_DISABLE_PLUGINS"] = f"cpu_mxfp4,hpu_mxfp4,cpu_int8_dense,{disabled}"
    env["QUANTREG_PLUGIN_IMPORT_TIMEOUT"] = "300"  # the plugin imports torch: a loaded host took > 10 s
    env.update(simulate("avx2"))  # vLLM's own kernel believed absent: only the curved methods are timed
    return env


def tune(site: Path, model: Path, out: Path, disabled: str) -> dict[str, Any]:
    """One ``quantreg tune --json`` with only the named entry point's curved methods left to measure."""
    proc = subprocess.run([str(QUANTREG), "tune", str(model), "--synthetic", "--budget", "1", "--out", str(out),
                           "--json"], capture_output=True, text=True, env=site_env(site, disabled), timeout=900,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout)
    data["text"] = out.read_text()
    return data


@pytest.fixture(scope="module")
def crossing(site: Path, tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Two runs in a row on the crossing pair (the second: the same table?)."""
    root = tmp_path_factory.mktemp("tune-crossing")
    return [tune(site, tiny, root / f"tuned-{i}.yaml", "parallel") for i in (1, 2)]


@pytest.fixture(scope="module")
def parallel(site: Path, tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return tune(site, tiny, tmp_path_factory.mktemp("tune-parallel") / "tuned.yaml", "crossing")


def decision(text: str) -> list[dict[str, Any]]:
    """What a table decides: each rule's match and chain (the evidence's milliseconds differ run to run)."""
    return [{k: r[k] for k in ("match", "method")} for r in yaml.safe_load(text)["rules"]]


@pytest.mark.plugin1
def test_crossing_curves_write_one_crossover_rule_pair(crossing: list[dict[str, Any]]) -> None:
    first = crossing[0]
    assert decision(first["text"]) == [
        {"match": {**KEY, "tokens": "<=8"}, "method": ["tune_decode", "tune_prefill"]},
        {"match": {**KEY, "tokens": ">8"}, "method": ["tune_prefill", "tune_decode"]},
    ], first["text"]
    assert 'tokens: "<=8"' in first["text"] and 'tokens: ">8"' in first["text"]  # the spelling the key reads
    cross = first["split"]["crossover"]
    assert (cross["tokens"], cross["small"], cross["large"]) == (8, "tune_decode", "tune_prefill")
    # apart beyond noise where the sleeps differ 10x (and usually where they differ 2x: a noisy round may tie one)
    assert cross["small_wins"] == [1, 2, 4, 8] and cross["large_wins"] and set(cross["large_wins"]) <= set(COUNTS[4:])
    # the envelope: within 5 % of the best (or within noise of it) at every measured count, said so
    env = cross["envelope"]
    assert env["ok"] and set(env["methods"]) == {str(t) for t in COUNTS}
    assert env["text"].startswith("within ") and "NOT" not in env["text"]
    # the single method would not do: one of the two is beaten beyond noise somewhere
    assert not first["split"]["single_envelope"]["ok"]
    # the evidence: the curve (median and spread per method per count) in the answer and in both rules
    assert first["tokens"] == COUNTS
    for method in ("tune_decode", "tune_prefill"):
        assert set(first["curve"][method]) == {str(t) for t in COUNTS}
        assert all(p["ms"] > 0 and p["spread"] is not None for p in first["curve"][method].values())
    for rule in yaml.safe_load(first["text"])["rules"]:
        ms = {r["method"]: r["ms"] for r in rule["tuned"]["results"]}
        assert set(ms["tune_decode"]) == {str(t) for t in COUNTS}
        assert any(line.startswith("crossover at 8 tokens: tune_decode for <= 8") for line in rule["tuned"]["ranking"])
        assert rule["tuned"]["pins"]["shape"]  # each rule is checked where it decides, like a single one


@pytest.mark.plugin1
def test_tune_writes_the_same_crossover_table_twice_in_a_row(crossing: list[dict[str, Any]]) -> None:
    assert decision(crossing[0]["text"]) == decision(crossing[1]["text"])
    assert crossing[0]["split"]["crossover"]["tokens"] == crossing[1]["split"]["crossover"]["tokens"]


@pytest.mark.plugin1
def test_curves_that_do_not_cross_write_the_single_rule(parallel: dict[str, Any]) -> None:
    assert decision(parallel["text"]) == [{"match": KEY, "method": ["tune_flat", "tune_prefill"]}]
    assert parallel["split"]["crossover"] is None
    assert parallel["split"]["single_envelope"]["ok"]
    assert parallel["split"]["text"].startswith("no crossover: one method for every token count (tune_flat")
    rule = yaml.safe_load(parallel["text"])["rules"][0]
    assert rule["tuned"]["ranking"][-1] == parallel["split"]["text"]  # said in the table too


@pytest.mark.plugin1
def test_each_side_of_the_written_pair_is_a_valid_rule_without_its_tokens_key(
        crossing: list[dict[str, Any]], site: Path, tmp_path: Path) -> None:
    """The evidence both rules carry loads today (real loader, real CLI), independent of the tokens key."""
    for i, rule in enumerate(yaml.safe_load(crossing[0]["text"])["rules"]):
        rule["match"].pop("tokens")
        path = tmp_path / f"side-{i}.yaml"
        path.write_text(yaml.safe_dump({"version": 1, "rules": [rule]}, sort_keys=False))
        proc = subprocess.run([str(QUANTREG), "validate", str(path)], capture_output=True, text=True, timeout=120,
                              env=site_env(site, "parallel"))
        assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.plugin1
def test_the_written_crossover_table_validates(crossing: list[dict[str, Any]], site: Path, tmp_path: Path) -> None:
    path = tmp_path / "tuned.yaml"
    path.write_text(crossing[0]["text"])
    proc = subprocess.run([str(QUANTREG), "validate", str(path)], capture_output=True, text=True, timeout=120,
                              env=site_env(site, "parallel"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
