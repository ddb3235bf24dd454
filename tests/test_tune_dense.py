"""``quantreg tune --layers``: GPT-OSS's dense layers measured on vLLM's own classes (issue 30).

The pure half (``--layers`` parsing, the lossy judgement, refusals before measuring) runs the real
CLI without vLLM. The measuring half runs real ``quantreg tune`` on the tiny GPT-OSS checkpoint
(quantreg/tiny: hidden 128, 4 heads of 64, 2 KV heads, vocabulary 201,088) with the installed
``cpu_int8_dense`` plugin: vLLM's ``QKVParallelLinear`` / ``RowParallelLinear`` / ``GateLinear`` /
``ParallelLMHead`` built, loaded and timed; the table it writes validated, explained and planned;
its shape pins checked by the dense seam while vLLM builds a real lm_head for the checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import DENSE_CHILD_HEAD, QUANTREG

from quantreg.host import host_facts, simulate
from quantreg.tune.dense import LOSSY_FLOOR, is_lossy, judge_lossy, parse_layers
from quantreg.tune.rank import TOKENS, Result

pytestmark = pytest.mark.usefixtures("clean_env")

KINDS = ("attention", "dense", "lm_head")
TINY = {"attention": {"hidden": 128, "heads": 4, "kv_heads": 2, "head_dim": 64},
        "dense": {"hidden": 128, "experts": 4}, "lm_head": {"hidden": 128, "vocab": 201088}}
BUDGET = "6"
INT8 = ("cpu_int8_dense", "cpu_int8_dense_kernel")
"""The installed plugin's dense methods: vLLM's oneDNN int8 GEMM (VNNI hosts) and its own kernel (any AVX2)."""
NO_VNNI = "cannot run here: needs cpu flag avx512_vnni or avx_vnni, this host has "
"""Why ``cpu_int8_dense`` is not measured on a host without VNNI (its ``host:`` declaration, issue 46
class 3: oneDNN's int8 GEMM saturates on AVX2 alone)."""


def vnni_here() -> bool:
    """The real CPU (the children get no simulated flags unless a test passes them) has VNNI."""
    facts = host_facts()
    return facts.has("avx512_vnni") or facts.has("avx_vnni")


def cli(*args: str, timeout: float = 600, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    # quantreg-cpu-bf16-dense (plugin #4) adds a faithful dense method tune would measure and may
    # chain; these tests are about the int8 plugin's lossy judgement, so it is left out here.
    env["QUANTREG_DISABLE_PLUGINS"] = "cpu_bf16_dense"
    env.update(extra)
    return subprocess.run([str(QUANTREG), *args], capture_output=True, text=True, env=env, timeout=timeout)


# -- the pure half ---------------------------------------------------------------------------------

def test_layers_parse_to_kinds_in_the_documented_order() -> None:
    assert parse_layers("experts") == (("experts",), None)
    assert parse_layers("lm_head,attention") == (("attention", "lm_head"), None)
    assert parse_layers(" lm_head , dense ") == (("dense", "lm_head"), None)
    assert parse_layers("all") == (("experts", "attention", "dense", "lm_head"), None)
    for bad, said in [("lm-head", "unknown layer kind 'lm-head'; did you mean 'lm_head'?"),
                      ("", "an empty layer kind"), ("lm_head,,dense", "an empty layer kind"),
                      ("all,experts", "'all' already names every kind")]:
        kinds, problem = parse_layers(bad)
        assert kinds == () and problem is not None and said in problem, (bad, problem)
        assert problem.startswith("--layers ")


@pytest.mark.parametrize(("args", "said"), [
    (("--layers", "lm-head"), "--layers lm-head: unknown layer kind 'lm-head'; did you mean 'lm_head'?"),
    (("--layers", "all,experts"), "'all' already names every kind"),
    (("--allow-lossy",), "--allow-lossy: only dense layer kinds have a lossy judgement"),
    (("--layers", "lm_head", "--device", "hpu"), "--device hpu: tune measures on the CPU only"),
    # --tokens is the experts' crossover curve: passed to their half, refused (not ignored) without it
    (("--layers", "lm_head", "--tokens", "1,8"), "--tokens: the token counts of the experts' crossover curve; "
                                                 "--layers lm_head names no experts"),
    (("--layers", "experts,lm_head", "--tokens", "1,x"), "--tokens 1,x: x is not a token count"),
    (("--layers", "experts", "--allow-lossy", "--tokens", "0"), "--allow-lossy: only dense layer kinds"),
])
def test_bad_layer_arguments_are_one_line_before_anything_is_read(tmp_path: Path, args: tuple[str, ...],
                                                                    said: str) -> None:
    out = cli("tune", str(tmp_path / "no-such-checkpoint"), *args, "--json", "--out", str(tmp_path / "t.yaml"))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert json.loads(out.stdout)["ok"] is False
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("quantreg tune: ") and said in lines[0], lines
    assert not (tmp_path / "t.yaml").exists()


def test_a_checkpoint_without_the_dense_sizes_or_of_another_model_is_refused_by_name(tmp_path: Path) -> None:
    config = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "num_hidden_layers": 1,
              "num_local_experts": 4, "num_experts_per_tok": 2, "hidden_size": 128, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "quantization_config": {"quant_method": "mxfp4"}}  # no vocab_size
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = cli("tune", str(tmp_path), "--layers", "lm_head", "--out", str(tmp_path / "t.yaml"))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "config.json: hidden_size, vocab_size: expected positive whole numbers for the lm_head" in out.stderr
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 1000, "model_type": "llama"}))
    out = cli("tune", str(tmp_path), "--layers", "attention", "--out", str(tmp_path / "t.yaml"))
    assert out.returncode == 1 and "model_type llama: tune builds the dense layers of gpt_oss only" in out.stderr
    assert not (tmp_path / "t.yaml").exists()


def test_an_lm_head_that_cannot_fit_in_memory_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    config = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "num_hidden_layers": 1,
              "num_local_experts": 4, "num_experts_per_tok": 2, "hidden_size": 1 << 16, "intermediate_size": 2880,
              # inside the bounds of a size (quantreg/bounds.py, 2^20), 640 GiB of bf16 copies together
              "vocab_size": 1 << 20, "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = cli("tune", str(tmp_path), "--layers", "lm_head", "--json", "--out", str(tmp_path / "t.yaml"))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    error = json.loads(out.stdout)["error"]
    assert "measuring the lm_head layers at these sizes needs about" in error, error
    assert "GiB is available here; nothing measured" in error and not (tmp_path / "t.yaml").exists()


def test_a_method_beyond_twice_bf16s_error_is_lossy_and_refused_unless_allowed() -> None:
    assert not is_lossy(0.004, 0.003)          # within 2x bf16's own rounding
    assert is_lossy(0.011, 0.0035)             # an int8 copy: ~3x
    assert not is_lossy(LOSSY_FLOOR / 2, 1e-5)  # beyond 2x, but below the floor: not lossy
    assert is_lossy(0.002, None)               # no bf16 baseline: the floor alone

    def results() -> list[Result]:
        ms = {t: 1.0 for t in TOKENS}
        return [Result("vllm", ok=True, ms=dict(ms), rel_error=0.0035),
                Result("int8", ok=True, ms=dict(ms), rel_error=0.011),
                Result("close", ok=True, ms=dict(ms), rel_error=0.005)]

    refused = results()
    assert judge_lossy(refused, allow=False) == ["int8"]
    int8 = refused[1]
    assert not int8.ok and int8.error is not None and int8.error.startswith("lossy: float64 error 0.011 > 2 x")
    assert "refused without --allow-lossy" in int8.error and int8.ms  # still timed: the trade is shown
    assert refused[0].ok and refused[2].ok
    allowed = results()
    assert judge_lossy(allowed, allow=True) == ["int8"]
    assert allowed[1].ok and any("chained because --allow-lossy" in w for w in allowed[1].warnings)


# -- the measuring half: real vLLM layers ------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("tune-dense") / "model"
    out = cli("tiny-model", str(model))
    assert out.returncode == 0, out.stderr
    return model


@pytest.fixture(scope="module")
def tuned(tiny: Path) -> tuple[Path, dict[str, Any]]:
    """One real run over the three dense kinds, the checkpoint's own weights, no --allow-lossy."""
    table = tiny.parent / "tuned.yaml"
    out = cli("tune", str(tiny), "--layers", ",".join(KINDS), "--budget", BUDGET, "--json", "--out", str(table))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    return table, json.loads(out.stdout)


@pytest.mark.vllm  # real vLLM layers
def test_tokens_reaches_the_experts_half_of_a_layers_run(tiny: Path, tmp_path: Path) -> None:
    """``--layers experts,dense --tokens 2``: the experts are timed at 2 tokens (and the score's counts),
    the router at the score's counts only; one table holds both kinds' rules."""
    table = tmp_path / "tuned.yaml"
    out = cli("tune", str(tiny), "--layers", "experts,dense", "--tokens", "2", "--synthetic", "--budget", BUDGET,
              "--json", "--out", str(table))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    keys = json.loads(out.stdout)["keys"]
    assert keys["experts"]["tokens"] == sorted({2, *TOKENS}), keys["experts"]["tokens"]
    timed = [r for r in keys["experts"]["results"] if r["ok"]]
    assert timed and all(set(r["ms"]) == {str(t) for t in sorted({2, *TOKENS})} for r in timed), timed
    assert all(set(r["ms"]) == {str(t) for t in TOKENS} for r in keys["dense"]["results"] if r["ms"])
    kinds = [r["match"].get("layer", "experts") for r in yaml.safe_load(table.read_text())["rules"]]
    assert "experts" in kinds and "dense" in kinds, kinds


@pytest.mark.vllm  # real vLLM layers
def test_each_dense_kind_is_measured_on_vllms_layers_and_int8_is_refused_as_lossy(
        tuned: tuple[Path, dict[str, Any]]) -> None:
    _, answer = tuned
    assert answer["ok"] and answer["layers"] == list(KINDS) and answer["allow_lossy"] is False
    for kind in KINDS:
        got = answer["keys"][kind]
        assert got["key"] == {"quant_format": "gpt_oss_mxfp4", "model_type": "gpt_oss", "device": "cpu",
                              "layer": kind}
        by = {r["method"]: r for r in got["results"]}
        assert set(by) == {"vllm", *INT8}, by  # MoE methods do not declare dense kinds
        assert by["vllm"]["ok"] and 0 < by["vllm"]["rel_error"] < 0.008, by["vllm"]  # bf16 rounding only
        lossy = [name for name in INT8 if name != "cpu_int8_dense" or vnni_here()]
        for name in lossy:  # measured on every kind the method runs on: lossy, refused
            int8 = by[name]
            assert not int8["ok"] and int8["error"].startswith("lossy: float64 error "), int8
            assert "refused without --allow-lossy" in int8["error"]
            assert int8["rel_error"] > 2 * by["vllm"]["rel_error"]
            assert set(int8["ms"]) == {str(t) for t in TOKENS}  # timed anyway: what the loss would buy is shown
        if not vnni_here():  # an AVX2-only host: passed over by its declaration, never built nor timed
            int8 = by["cpu_int8_dense"]
            assert not int8["ok"] and int8["error"].startswith(NO_VNNI) and not int8["ms"], int8
        assert got["chain"] == ["vllm"] and sorted(got["lossy"]) == sorted(lossy)
        assert got["rounds"] >= 5
        assert got["tuned"]["shape"] == {**TINY[kind], "weights": "layer 0" if kind != "lm_head" else "lm_head"}
        assert got["tuned"]["pins"]["shape"] == TINY[kind]


@pytest.mark.vllm  # real vLLM layers
def test_the_written_dense_rules_validate_and_decide(tuned: tuple[Path, dict[str, Any]], tiny: Path) -> None:
    table, _ = tuned
    rules = yaml.safe_load(table.read_text())["rules"]
    assert [r["match"].get("layer") for r in rules] == list(KINDS)
    assert all(r["method"] == ["vllm"] and r["tuned"]["pins"]["shape"] == TINY[r["match"]["layer"]] for r in rules)
    out = cli("validate", str(table))
    assert out.returncode == 0 and out.stdout.strip() == "ok: 1 table(s) valid", out.stdout + out.stderr
    shown = cli("explain", "gpt_oss_mxfp4", "gpt_oss", "cpu", "--layer", "lm_head", "--config", str(table))
    assert shown.returncode == 0, shown.stderr
    assert "key      (gpt_oss_mxfp4, gpt_oss, cpu, lm_head)" in shown.stdout
    assert "method   vllm" in shown.stdout and f"rule     {table}:" in shown.stdout
    tuned_line = next(line for line in shown.stdout.splitlines() if line.startswith("tuned    "))
    assert "chosen by quantreg tune on" in tuned_line
    assert "; refused: " in tuned_line, tuned_line
    assert f"cpu_int8_dense ({'lossy: float64 error' if vnni_here() else NO_VNNI}" in tuned_line, tuned_line
    assert "cpu_int8_dense_kernel (lossy: float64 error" in tuned_line, tuned_line
    moe = cli("explain", "gpt_oss_mxfp4", "gpt_oss", "cpu", "--config", str(table), "--json")
    assert str(table) not in json.dumps(json.loads(moe.stdout)["rule"])  # the experts are not decided by it
    plan = json.loads(cli("plan", str(tiny), "--config", str(table), "--json").stdout)
    dense = plan["devices"]["cpu"]["dense"]
    assert {k: v["method"] for k, v in dense.items()} == dict.fromkeys(KINDS, "vllm")
    assert all(v["rule"].startswith(f"{table}:") and "stale" not in v for v in dense.values()), dense


@pytest.mark.vllm  # real vLLM layers
def test_plan_names_a_dense_shape_pin_the_checkpoint_does_not_have(tuned: tuple[Path, dict[str, Any]],
                                                                    tiny: Path, tmp_path: Path) -> None:
    table, _ = tuned
    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    plan = json.loads(cli("plan", str(other), "--config", str(table), "--json").stdout)
    dense = plan["devices"]["cpu"]["dense"]
    assert dense["lm_head"]["stale"] == ["shape: tuned with {hidden: 128, vocab: 201088}, running "
                                         "{hidden: 128, vocab: 1000}"], dense
    assert "stale" not in dense["attention"] and "stale" not in dense["dense"]
    text = cli("plan", str(other), "--config", str(table)).stdout
    assert "warning lm_head tuned rule is stale: shape: tuned with {hidden: 128, vocab: 201088}" in text


@pytest.mark.vllm  # real vLLM layers
@pytest.mark.parametrize("kind", ["here", "avx2"])
def test_allow_lossy_chains_the_int8_method_and_says_so(tiny: Path, tmp_path: Path, kind: str) -> None:
    """With VNNI the int8 method is measured, lossy, and chained because of --allow-lossy; on an
    AVX2-only host (real, or simulated by ``QUANTREG_HOST_CPU_FLAGS``) it is never measured and the
    chain keeps vLLM's method alone, --allow-lossy or not (issue 46, class 3)."""
    extra = simulate("avx2") if kind == "avx2" else {}
    table = tmp_path / "lossy.yaml"
    out = cli("tune", str(tiny), "--layers", "lm_head", "--allow-lossy", "--synthetic", "--budget", BUDGET,
              "--json", "--out", str(table), **extra)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    got = json.loads(out.stdout)["keys"]["lm_head"]
    int8 = next(r for r in got["results"] if r["method"] == "cpu_int8_dense")
    (rule,) = yaml.safe_load(table.read_text())["rules"]
    assert got["tuned"]["shape"]["weights"] == "synthetic" and rule["match"]["layer"] == "lm_head"
    kernel = next(r for r in got["results"] if r["method"] == "cpu_int8_dense_kernel")
    # the plugin's own kernel runs on every kind (AVX2 path without saturation): lossy, chained
    assert kernel["ok"] and any("chained because --allow-lossy" in w for w in kernel["warnings"]), kernel
    if kind == "here" and vnni_here():
        assert sorted(got["lossy"]) == sorted(INT8) and set(got["chain"]) == {"vllm", *INT8}, got
        assert int8["ok"] and any("chained because --allow-lossy" in w for w in int8["warnings"]), int8
        assert sorted(rule["note"].split("lossy, chained with --allow-lossy: ")[1].split(", ")) == sorted(INT8)
    else:
        assert got["lossy"] == ["cpu_int8_dense_kernel"], got
        assert set(got["chain"]) == {"vllm", "cpu_int8_dense_kernel"}, got
        assert not int8["ok"] and int8["error"].startswith(NO_VNNI) and not int8["ms"], int8
        if extra:
            assert int8["error"].endswith("; flags simulated by QUANTREG_HOST_CPU_FLAGS"), int8
        assert "cpu_int8_dense" not in rule["method"]
    assert cli("validate", str(table)).returncode == 0


START_UP = DENSE_CHILD_HEAD + """
one_rank(VllmConfig(model_config=ModelConfig(model=sys.argv[1], dtype="bfloat16")))
out = {}
import vllm.model_executor.layers.vocab_parallel_embedding as vpe
registry = Registry.build(config=[sys.argv[2]])
assert not registry.faults, registry.faults
set_registry(registry)
DenseSeam().patch_lm_head(vpe)
from vllm.config import get_current_vllm_config
hf = get_current_vllm_config().model_config.hf_config
try:
    vpe.ParallelLMHead(hf.vocab_size, hf.hidden_size, prefix="lm_head")
except QuantregError as exc:
    out["raised"] = str(exc)
out["log"] = records
print(json.dumps(out))
"""


@pytest.mark.vllm
def test_start_up_checks_a_dense_rules_shape_pin_on_the_model_vllm_builds(
        tuned: tuple[Path, dict[str, Any]], tiny: Path, tmp_path: Path) -> None:
    """vLLM's real ModelConfig of the checkpoint; the lm_head built through the dense seam."""
    table, _ = tuned
    text = table.read_text()
    assert text.count("vocab: 201088") == 2  # tuned.shape and tuned.pins.shape
    elsewhere = tmp_path / "elsewhere.yaml"
    elsewhere.write_text(text.replace("vocab: 201088", "vocab: 1000"))
    strict = tmp_path / "strict.yaml"
    strict.write_text("strict: true\n" + elsewhere.read_text())

    def start(path: Path) -> dict[str, Any]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
        done = subprocess.run([sys.executable, "-c", START_UP, str(tiny), str(path)], capture_output=True,
                              text=True, env=env, timeout=600, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    # only the shape is this test's: a loaded shared host can move the bandwidth pin beyond its factor
    same = start(table)
    assert "raised" not in same and not [m for lvl, m in same["log"] if "is stale: shape:" in m], same
    assert any("(gpt_oss_mxfp4, gpt_oss, cpu, lm_head) -> vllm" in m for _, m in same["log"]), same
    lenient = start(elsewhere)
    stale = [(lvl, m) for lvl, m in lenient["log"] if "is stale: shape:" in m]
    assert len(stale) == 1 and stale[0][0] == "WARNING", lenient
    assert stale[0][1].startswith(f"quantreg: tuned rule for (gpt_oss_mxfp4, gpt_oss, cpu, lm_head) [{elsewhere}:")
    assert stale[0][1].endswith("is stale: shape: tuned with {hidden: 128, vocab: 1000}, running {hidden: 128, "
                                "vocab: 201088}; the rule still decides (re-run quantreg tune)")
    assert "raised" not in lenient
    raised = start(strict)["raised"]
    assert raised.startswith("quantreg (strict): tuned rule for (gpt_oss_mxfp4, gpt_oss, cpu, lm_head)")
    assert "was measured elsewhere: " in raised and "\n" not in raised
    assert "shape: tuned with {hidden: 128, vocab: 1000}, running {hidden: 128, vocab: 201088}" in raised
