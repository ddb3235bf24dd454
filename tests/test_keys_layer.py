"""The layer kind in keys and rules (issue 30): parsing, precedence, ambiguity, JSON, explain."""

from __future__ import annotations

import json
from pathlib import Path

from core_support import run_cli

from quantreg.keys import EXPERTS, LAYER_KINDS, Key, Match
from quantreg.registry import Registry
from quantreg.table.file import Tier, parse_table, rule_json
from quantreg.table.schema import table_schema

DENSE = """version: 1
rules:
  - match: {quant_format: gpt_oss_mxfp4, device: cpu}
    method: vllm
    note: experts
  - match: {quant_format: gpt_oss_mxfp4, device: cpu, layer: lm_head}
    method: vllm
    note: head
  - match: {device: cpu, layer: [attention, dense]}
    method: vllm
    note: dense
"""


def test_key_defaults_to_the_experts_and_shows_other_kinds() -> None:
    assert LAYER_KINDS == ("experts", "attention", "dense", "lm_head")
    moe, head = Key("q", "m", "cpu"), Key("q", "m", "cpu", "lm_head")
    assert moe.layer == EXPERTS and moe == ("q", "m", "cpu") and hash(moe) == hash(("q", "m", "cpu"))
    assert head != ("q", "m", "cpu") and head != moe and head == moe.of_layer("lm_head")
    assert str(moe) == "(q, m, cpu)" and str(head) == "(q, m, cpu, lm_head)"
    assert moe.as_json() == {"quant_format": "q", "model_type": "m", "device": "cpu"}
    assert head.as_json()["layer"] == "lm_head"


def test_rules_match_only_their_layer_kinds() -> None:
    table, problems, _ = parse_table(DENSE, "t.yaml", Tier.USER)
    assert table is not None and not problems
    moe, head, dense = table.rules
    assert moe.match.layer is None and moe.match.layers == (EXPERTS,)
    assert head.match.layer == ("lm_head",) and dense.match.layer == ("attention", "dense")
    assert (moe.match.specificity, head.match.specificity, dense.match.specificity) == (2, 3, 2)
    assert "layer" not in rule_json(moe)["match"] and rule_json(head)["match"]["layer"] == ["lm_head"]
    assert str(head.match) == "(gpt_oss_mxfp4, *, cpu, lm_head)" and str(moe.match) == "(gpt_oss_mxfp4, *, cpu)"
    assert not moe.match.overlaps(head.match) and head.match.overlaps(Match(layer=("lm_head", "dense")))


def test_the_index_answers_per_layer_kind_and_finds_no_tie_across_kinds(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(DENSE)
    registry = Registry.build(config=[path], entry_points=False)
    assert not registry.faults  # the three rules overlap on their fields, never on their kinds
    notes = {k: (d.rule.note if d.rule else None) for k in LAYER_KINDS
             for d in [registry.resolve(Key("gpt_oss_mxfp4", "gpt_oss", "cpu", k))]}
    assert notes == {"experts": "experts", "attention": "dense", "dense": "dense", "lm_head": "head"}
    # a key of a kind no rule names gets vLLM's own method, whatever the MoE rules say
    assert registry.resolve(Key("fp8", "llama", "cuda", "lm_head")).rule is None


def test_two_rules_of_one_kind_still_tie(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("version: 1\nrules:\n  - match: {layer: lm_head}\n    method: vllm\n"
                    "  - match: {layer: [dense, lm_head]}\n    method: vllm\n")
    registry = Registry.build(config=[path], entry_points=False)
    assert any("ambiguous" in str(f) for f in registry.faults)


def test_bad_layer_values_are_located_problems() -> None:
    for value, words in (("lmhead", "did you mean 'lm_head'"), ('"*"', "'*' is not a layer kind"),
                         ("[]", "empty list"), ("3", "unknown layer kind int")):
        text = f"version: 1\nrules:\n  - match:\n      device: cpu\n      layer: {value}\n    method: vllm\n"
        table, problems, _ = parse_table(text, "t.yaml", Tier.USER)
        assert table is None
        assert [(p.line, p.key) for p in problems] == [(5, "rules[0].match.layer")], problems
        assert words in problems[0].message, problems[0].message


def test_schema_names_the_layer_kinds() -> None:
    layer = table_schema()["properties"]["rules"]["items"]["properties"]["match"]["properties"]["layer"]
    assert layer["anyOf"][0]["enum"] == list(LAYER_KINDS)


def test_explain_takes_a_layer(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(DENSE)
    done = run_cli("explain", "gpt_oss_mxfp4", "gpt_oss", "cpu", "--layer", "lm_head", "--config", str(path),
                   "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    text = json.dumps(data)
    assert '"layer": "lm_head"' in text and f"{path}:6" in text


def test_methods_declare_their_layer_kinds_and_chains_pass_over_the_others(tmp_path: Path) -> None:
    from quantreg.methods import Method, check_method

    assert Method("m", "a.b:C").layers == (EXPERTS,)
    assert check_method(Method("m", "a.b:C", layers=("lm_head", "dense"))) is None
    bad = check_method(Method("m", "a.b:C", layers=("lmhead",)))
    assert bad is not None and "layers must be a non-empty tuple of experts, attention, dense, lm_head" in bad
    path = tmp_path / "t.yaml"
    path.write_text("version: 1\nallow_import_targets: true\nmethods:\n  head_only:\n    target: a.b:C\n"
                    "    layers: [lm_head]\n  moe_only:\n    target: a.b:D\n"
                    "rules:\n  - match: {layer: [experts, lm_head]}\n    method: [head_only, moe_only]\n")
    registry = Registry.build(config=[path], entry_points=False)
    assert not registry.faults, registry.faults
    head = registry.resolve(Key("q", "m", "cpu", "lm_head"))
    moe = registry.resolve(Key("q", "m", "cpu"))
    assert head.method == "head_only" and moe.method == "moe_only"
    assert moe.chain[0].reason == "decides lm_head layers, not experts"


def test_table_methods_layers_are_checked() -> None:
    text = ("version: 1\nallow_import_targets: true\nmethods:\n  x:\n    target: a.b:C\n    layers: [head]\n"
            "rules: []\n")
    table, problems, _ = parse_table(text, "t.yaml", Tier.USER)
    assert table is None and [(p.line, p.key) for p in problems] == [(6, "methods.x.layers")], problems


def test_plan_and_doctor_show_the_dense_decisions(tmp_path: Path) -> None:
    from quantreg.models.gpt_oss import tiny_gpt_oss_config

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_gpt_oss_config()))
    path = tmp_path / "t.yaml"
    path.write_text(DENSE)
    done = run_cli("plan", str(model), "--device", "cpu", "--no-vllm", "--config", str(path), "--json")
    assert done.returncode == 0, done.stderr
    dense = json.loads(done.stdout)["devices"]["cpu"]["dense"]
    assert dense == {"attention": {"method": "vllm", "rule": f"{path}:9"},
                     "dense": {"method": "vllm", "rule": f"{path}:9"},
                     "lm_head": {"method": "vllm", "rule": f"{path}:6"}}
    text = run_cli("plan", str(model), "--device", "cpu", "--no-vllm", "--config", str(path)).stdout
    assert f"  lm_head   vllm [{path}:6]" in text.splitlines()
    plain = run_cli("plan", str(model), "--device", "cpu", "--no-vllm", "--json")
    assert "dense" not in json.loads(plain.stdout)["devices"]["cpu"]  # no dense rule: the plan reads as before
    doctor = run_cli("doctor", "--config", str(path))
    assert f"dense:     (gpt_oss_mxfp4, *, cpu, lm_head) -> vllm [{path}:6]" in doctor.stdout.splitlines()
    assert f"dense:     (*, *, cpu, attention) -> vllm [{path}:9]" in doctor.stdout.splitlines()
