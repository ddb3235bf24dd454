"""The whole-model bench (bench/wholemodel_bench.py) end to end at tiny size: no timing asserted.

One run: ``quantreg tiny-model`` writes the checkpoint, two vLLM-CPU variants (the registry's own
choice, and a ``--vllm-table LABEL=TABLE`` variant routed to ``mxfp4_reference``) and -- when
``bench/llama_setup.sh``'s environment exists -- llama.cpp on the GGUF its own converter made
from the same weights, interleaved for one round. The llama.cpp environment takes 10-30 minutes
to build, more than CI's budget allows, so without it that half is skipped *by the bench*, which
names the reason in its result (checked here); nothing stands in for llama.cpp.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from quantreg.testing.vllm_run import VLLM_MXFP4_METHOD

ROOT = Path(__file__).resolve().parents[2]
CPU_MXFP4 = "quantreg_cpu_mxfp4.method:CpuMxfp4MoEMethod"
REFERENCE = "quantreg_hpu_mxfp4.method:Mxfp4ReferenceMoEMethod"


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    pytest.importorskip("quantreg_hpu_mxfp4", reason="plugin #1 (mxfp4_reference) is not installed")
    tmp = tmp_path_factory.mktemp("wholemodel")
    table = tmp / "reference.yaml"
    table.write_text("version: 1\nrules:\n  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}\n"
                     "    method: mxfp4_reference\n")
    out = tmp / "result.json"
    proc = subprocess.run([sys.executable, "-m", "bench.wholemodel_bench", "--shape", "tiny", "--layers", "2",
                           "--rounds", "1", "--decode-tokens", "6", "--prefill-tokens", "24", "--work-dir", str(tmp),
                           "--llama-dense", "q8_0", "--vllm-table", f"reference={table}",
                           "--vllm-env", "reference=ATEN_CPU_CAPABILITY=avx2", "--split-sequences", "4",
                           "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "decode step" in proc.stdout and "decode step at 4 sequences" in proc.stdout
    data: dict[str, object] = json.loads(out.read_text())
    return data


def test_both_vllm_variants_measured_with_their_methods(result: dict[str, object], mxfp4_kernel_available: bool,
                                                        host_kind: object) -> None:
    engines = result["engines"]
    assert isinstance(engines, dict)
    default = engines["vLLM-CPU + quantreg (registry's choice) [eager]"]
    # The registry's choice on this host: vLLM's own kernel with AMX, plugin #2 without.
    assert default["moe_methods"] == [VLLM_MXFP4_METHOD if mxfp4_kernel_available else CPU_MXFP4]
    assert engines["reference [eager]"]["moe_methods"] == [REFERENCE]
    assert engines["reference [eager]"]["table"].endswith("reference.yaml")
    # vLLM's default mode (compiled) beside eager: same methods, measured; no module split (hooks do
    # not fire inside a compiled graph)
    for label in ("vLLM-CPU + quantreg (registry's choice)", "reference"):
        compiled = engines[label]
        assert compiled["mode"] == "default" and engines[f"{label} [eager]"]["mode"] == "eager"
        assert compiled["moe_methods"] == engines[f"{label} [eager]"]["moe_methods"]
        assert len(compiled["rounds"]) == 1 and "split" not in compiled
    for engine in (default, engines["reference [eager]"]):
        assert len(engine["rounds"]) == 1
        assert engine["held_bytes"]["experts"] > 0 and engine["held_bytes"]["embedding"] == 201088 * 128 * 2
        split = engine["split"]
        assert split["steps"] == 4 and split["moe_calls_per_step"] == 2  # 6 tokens: 6 forwards, 4 whole decode periods
        for key in ("moe_ms", "attention_dense_ms", "lm_head_ms", "step_ms"):
            assert split[key] > 0, (key, split)
        # --split-sequences 4: four sequences decode together, every step one forward for all four
        # (a server's step under four clients): the same layers per step, and four tokens per step
        together = engine["split_by_sequences"]["4"]
        assert together["steps"] == 4 and together["moe_calls_per_step"] == 2, together
        assert together["step_ms"] > 0 and together["moe_ms"] > 0
        assert engine["startup_split"]["weights_processing_s"] > 0
        assert engine["peak_rss_bytes"] > 0 and engine["bandwidth_fraction"] > 0
    assert default["startup_split"]["moe_repack_layers"] == 2


def test_a_variants_environment_reaches_the_process_that_measured_it(result: dict[str, object]) -> None:
    """``--vllm-env reference=ATEN_CPU_CAPABILITY=avx2``: the child reports torch running at AVX2 (the
    way the bench stands in for the AVX2 host kind on a wider CPU), and only in that variant."""
    engines = result["engines"]
    assert isinstance(engines, dict)
    for mode in ("", " [eager]"):
        forced = engines[f"reference{mode}"]
        assert forced["env"] == {"ATEN_CPU_CAPABILITY": "avx2"}
        assert forced["isa"]["torch_cpu_capability"] == "AVX2"
        assert forced["isa"]["forced"]["ATEN_CPU_CAPABILITY"] == "avx2"
        default = engines[f"vLLM-CPU + quantreg (registry's choice){mode}"]
        assert "env" not in default and "ATEN_CPU_CAPABILITY" not in default["isa"]["forced"]
        assert default["isa"]["torch_cpu_capability"] in ("AVX2", "AVX512")


def _bench() -> object:
    sys.path.insert(0, str(ROOT))
    import bench.wholemodel_bench as bench

    return bench


def test_sessions_keep_engines_apart_or_together_as_asked() -> None:
    """--alternate restarts each engine every round in rotated order, so two engines' round r are
    minutes apart; --one-at-a-time runs every round of one engine before the next."""
    bench = _bench()
    labels = ["A", "B", "C"]
    assert bench.sessions(labels, 2, "together") == [(["A", "B", "C"], [0, 1])]
    assert bench.sessions(labels, 2, "one-at-a-time") == [(["A"], [0, 1]), (["B"], [0, 1]), (["C"], [0, 1])]
    assert bench.sessions(labels, 3, "alternate") == [
        (["A"], [0]), (["B"], [0]), (["C"], [0]),
        (["B"], [1]), (["C"], [1]), (["A"], [1]),
        (["C"], [2]), (["A"], [2]), (["B"], [2])]
    with pytest.raises(ValueError, match="unknown layout"):
        bench.sessions(labels, 1, "sideways")


def test_bad_variant_options_stop_before_any_engine_starts(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Each bad option is one ``error:`` line on stderr and exit status 2 (bench/cli_args.fail), no traceback."""
    bench = _bench()
    assert bench.variant_env(["x=A_ISA=avx2", "x=B=1"], ["x", "y"]) == {"x": {"A_ISA": "avx2", "B": "1"}}

    def refused(call: Any, message: str) -> None:
        with pytest.raises(SystemExit) as stop:
            call()
        err = capsys.readouterr().err
        assert stop.value.code == 2 and message in err and len(err.splitlines()) == 1, err

    for item, message in (("x=A", "expects LABEL=KEY=VALUE"), ("x=not a name=1", "expects LABEL=KEY=VALUE"),
                          ("z=A=1", "no vLLM variant labelled 'z' (variants: x, y)")):
        refused(lambda item=item: bench.variant_env([item], ["x", "y"]), message)
    refused(lambda: bench.llama_builds(["avx2"]), "expects NAME=ENV_DIR")
    refused(lambda: bench.llama_builds([f"avx2={tmp_path}"]), "is not a finished bench/llama_setup.sh environment")


def test_llama_half_ran_or_was_skipped_by_name(result: dict[str, object]) -> None:
    engines, skipped = result["engines"], result["skipped"]
    assert isinstance(engines, dict) and isinstance(skipped, dict)
    label = "llama.cpp, dense q8_0"
    if label in skipped:
        assert "no llama environment" in skipped[label] and "llama_setup.sh" in skipped[label]
        assert result["ratios"] == {}
        return
    llama = engines[label]
    assert llama["gguf"].endswith("-q8_0.gguf")
    assert llama["held_bytes"]["experts"] > 0  # the GGUF's *_exps tensors (MXFP4)
    assert len(llama["rounds"]) == 1 and llama["decode_tok_s"] > 0
    ratios = result["ratios"]
    assert isinstance(ratios, dict)
    assert set(ratios) == {f"{v}{m} / {label}" for v in ("vLLM-CPU + quantreg (registry's choice)", "reference")
                           for m in ("", " [eager]")}


def test_rounds_that_disagree_are_flagged_not_medianed(result: dict[str, object]) -> None:
    """Every engine carries its rounds' range; a run whose rounds differ by more than the bound prints
    the range with a flag (issue 44: rounds of 0.87 and 4.32 tok/s were printed as their median)."""
    sys.path.insert(0, str(ROOT))
    from bench.common import DISAGREE_FACTOR, disagreement
    from bench.wholemodel_bench import table

    engines = result["engines"]
    assert isinstance(engines, dict)
    for r in engines.values():  # one round: a range of one value, nothing to disagree
        assert r["spread"]["decode_tok_s"] == {"min": r["decode_tok_s"], "max": r["decode_tok_s"], "disagree": False}
    assert " over 1 rounds: " in table(result) and "ROUNDS DISAGREE" not in table(result)
    result = copy.deepcopy(result)  # the module's other tests read the run as it was
    engines = result["engines"]
    assert isinstance(engines, dict)
    label = next(iter(engines))
    rounds = [0.87, 4.32, 4.1]
    engines[label]["rounds"] = [{"decode_tok_s": v} for v in rounds]
    engines[label]["spread"]["decode_tok_s"] = disagreement(rounds)
    flagged = [line for line in table(result).splitlines() if line.startswith(f"{label} decode over 3 rounds")]
    assert flagged == [f"{label} decode over 3 rounds: 0.87-4.32 ROUNDS DISAGREE (>x{DISAGREE_FACTOR}): "
                       "the median stands for neither"]
    assert not disagreement([4.0, 4.0 * DISAGREE_FACTOR])["disagree"]
    assert disagreement([4.0, 4.0 * DISAGREE_FACTOR + 0.01])["disagree"]
