"""``quantreg tune``'s crossover, pure half (no torch): the curve, the split, the envelope check, the YAML.

Issue 32, item 3: one rule for decode and prefill. Results here are built from known curves (a
few percent of round-to-round jitter, paired rounds as tune's interleaving gives them) so each
case is decided by the rule under test, not by luck; the measuring half, real vLLM layers at the
tiny shape, is tests/e2e/test_tune_crossover_vllm.py.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from core_support import QUANTREG

from quantreg import Key
from quantreg.tune import table as tune_table
from quantreg.tune.command import parse_tokens
from quantreg.tune.rank import DEFAULT_TOKENS, ENVELOPE_MARGIN, TOKENS, Result, curve, envelope, median, split

pytestmark = pytest.mark.usefixtures("clean_env")

KEY = Key("gpt_oss_mxfp4", "gpt_oss", "cpu")
COUNTS = list(DEFAULT_TOKENS)
JITTER = [1.0, 1.02, 0.99, 1.01, 0.98, 1.03, 1.0, 0.97]
EVIDENCE = {"at": "2026-12-04T14:00:00Z", "host": {"kind": "amx", "cores": 2}, "vllm": "0.32.0",
            "torch": "2.13.0+cpu", "tolerance": 0.02, "budget_s": 120.0, "rounds": 8,
            "shape": {"experts": 32, "hidden": 2880, "intermediate": 2880, "top_k": 4}}


def curved(name: str, ms: Callable[[int], float], shift: int = 0) -> Result:
    """A passing result whose round i at every count is ``ms(t)`` times a jitter (rounds paired across methods)."""
    jitter = JITTER[shift:] + JITTER[:shift]
    samples = {t: [ms(t) * j for j in jitter] for t in COUNTS}
    return Result(name, ok=True, ms={t: median(v) for t, v in samples.items()}, samples=samples, rel_error=0.004)


def decoder() -> Result:  # 1 ms + 0.5 ms per token: fastest for small forwards
    return curved("mxfp4_reference", lambda t: 1.0 + 0.5 * t)


def prefiller() -> Result:  # 8 ms + 0.05 ms per token: fastest for large ones
    return curved("vllm", lambda t: 8.0 + 0.05 * t, shift=3)


def test_the_default_counts_double_from_decode_to_512_and_hold_the_score_counts() -> None:
    assert COUNTS == [2 ** i for i in range(10)] and set(TOKENS) <= set(COUNTS)
    assert parse_tokens(None) == (COUNTS, None)
    assert parse_tokens("8, 32") == ([1, 8, 32, 64, 256], None)  # the score's 1, 64, 256 always


@pytest.mark.parametrize("text", ["", "1,,2", "0", "-4", "1.5", "9999999", "²"])
def test_bad_token_counts_are_refused_with_what_was_expected(text: str) -> None:
    counts, problem = parse_tokens(text)
    assert counts is None and problem is not None
    assert problem.startswith("--tokens ") and "expected comma-separated whole numbers from 1 to 8192" in problem


def test_crossing_curves_give_one_crossover_whose_envelope_is_within_5_percent() -> None:
    # decoder vs prefiller: 1.5/8.05 at 1 ... 5/8.4 at 8 (apart), 9/8.8 at 16 (tie), 17/9.6 at 32 (apart)
    decided = split([decoder(), prefiller()], COUNTS, "vllm")
    assert not decided.single_envelope.ok if decided.single_envelope else False  # one method alone will not do
    cross = decided.crossover
    assert cross is not None
    assert (cross.tokens, cross.small, cross.large) == (8, "mxfp4_reference", "vllm")
    assert cross.small_wins == [1, 2, 4, 8] and cross.large_wins == [32, 64, 128, 256, 512]
    env = cross.envelope
    assert env.ok and env.methods == {t: ("mxfp4_reference" if t <= 8 else "vllm") for t in COUNTS}
    assert env.best == env.methods and env.worst[1] == 1.0  # at 16 (the tie) vllm is the better by 2 %
    assert env.text().startswith("within 5% of the best method at every")
    assert decided.text().startswith("crossover at 8 tokens: mxfp4_reference for <= 8")


def test_the_bound_is_the_lower_middle_of_the_counts_where_the_two_tie() -> None:
    # a wide tie (within 5 %) from 4 to 64 tokens: the bound is a fixed function of the verdicts
    slow_start = curved("vllm", lambda t: 10.0 if t < 4 else (1.0 if t <= 64 else 0.5))
    fast_start = curved("mxfp4_reference", lambda t: 5.0 if t < 4 else (1.02 if t <= 64 else 2.0), shift=2)
    cross = split([fast_start, slow_start], COUNTS, "vllm").crossover
    assert cross is not None and cross.small_wins == [1, 2] and cross.large_wins == [128, 256, 512]
    assert cross.tokens == 8  # bounds 2, 4, 8, 16, 32, 64 -> the lower middle (third of six)
    t, worst = cross.envelope.worst  # 1.02 vs 1.0 at 4 and 8 tokens: within 5 % by the medians, said
    assert t in (4, 8) and worst == pytest.approx(1.02, rel=0.01) and worst <= 1 + ENVELOPE_MARGIN
    assert cross.envelope.ok and cross.envelope.text().startswith("within 5% of the best method at every")


def test_curves_that_do_not_cross_keep_one_method() -> None:
    flat = curved("vllm", lambda t: 0.5 + 0.01 * t)
    decided = split([decoder(), flat], COUNTS, "vllm")
    assert decided.crossover is None and decided.single_envelope is not None and decided.single_envelope.ok
    assert decided.text().startswith("no crossover: one method for every token count (vllm, envelope within 5%")


def test_the_envelope_check_refuses_a_crossover_a_third_method_beats_in_the_middle() -> None:
    """No single crossover is within 5 % of the best: said plainly, and the best single method stands."""
    middle = curved("cpu_mxfp4", lambda t: 2.0 if 8 <= t <= 64 else 1000.0, shift=5)
    results = [decoder(), prefiller(), middle]
    rules, decided = tune_table.tuned_rules(KEY, results, EVIDENCE, counts=COUNTS, prior=["vllm"])
    assert decided.single == "mxfp4_reference"  # the decode-weighted score's winner: the rule written
    assert decided.crossover is None and decided.candidates  # pairs cross, none passes the envelope check
    assert all(not c.envelope.ok for c in decided.candidates)
    text = decided.text()
    assert text.startswith("no crossover: one method for every token count (mxfp4_reference, envelope NOT "
                           "within 5% of the best method (worst x")
    assert "no single crossover is within noise of the best either (the closest: crossover at" in text
    assert len(rules) == 1 and "tokens" not in rules[0]["match"] and rules[0]["tuned"]["ranking"][-1] == text
    assert rules[0]["method"][0] == "mxfp4_reference"


def test_envelope_within_noise_is_not_beaten_and_beyond_noise_is() -> None:
    a = curved("a", lambda t: 1.0)
    near = curved("b", lambda t: 1.08, shift=4)  # 8 % slower by the medians ...
    noisy = Result("b", ok=True, ms=near.ms, samples={t: [v * (1.6 if i % 2 else 0.7) for i, v in enumerate(s)]
                                                      for t, s in near.samples.items()})
    assert not envelope([a, near], {t: "b" for t in COUNTS}).ok  # ... beyond noise: beaten
    within = envelope([a, noisy], {t: "b" for t in COUNTS})  # ... within noise: not beaten, said so
    assert within.ok and "within noise of the best" in within.text() and "over 5% by the medians" in within.text()


def test_the_written_pair_is_the_tokens_key_and_carries_the_curve(tmp_path: Path) -> None:
    results = [decoder(), prefiller(), Result("cpu_mxfp4", ok=False, error="cannot run here: simulated")]
    rules, decided = tune_table.tuned_rules(KEY, results, EVIDENCE, counts=COUNTS, prior=["vllm"])
    text = tune_table.render(rules)
    assert 'tokens: "<=8"' in text and 'tokens: ">8"' in text  # the spelling the tokens key reads
    loaded = yaml.safe_load(text)["rules"]
    assert [(r["match"], r["method"]) for r in loaded] == [
        ({**KEY._asdict(), "tokens": "<=8"}, ["mxfp4_reference", "vllm"]),
        ({**KEY._asdict(), "tokens": ">8"}, ["vllm", "mxfp4_reference"]),
    ]
    for rule in loaded:
        ms = {r["method"]: r["ms"] for r in rule["tuned"]["results"]}
        assert ms["vllm"] == {str(t): round(prefiller().ms[t], 4) for t in COUNTS}  # the curve, every count
        assert rule["tuned"]["ranking"][-1] == decided.text()
        assert decided.crossover is not None  # and the same decision as data: what a tool reads
        assert rule["tuned"]["crossover"] == {"tokens": 8, "small": "mxfp4_reference", "large": "vllm",
                                              "worst_ratio": round(decided.crossover.envelope.worst[1], 4),
                                              "worst_at": decided.crossover.envelope.worst[0]}
    assert loaded[0]["tuned"]["phase_weights"] == {str(t): pytest.approx(0.25) for t in (1, 2, 4, 8)}
    assert json.dumps(curve(results, COUNTS))  # JSON-ready: median and spread per method per count
    assert curve(results, COUNTS)["vllm"]["512"]["ms"] == round(prefiller().ms[512], 4)


def test_explain_reads_the_crossover_from_the_evidence() -> None:
    """``tuned.crossover`` as written loads and is said on explain's tuned line (no prose parsed)."""
    from quantreg.table.tuned import parse_tuned

    rules, _ = tune_table.tuned_rules(KEY, [decoder(), prefiller()], EVIDENCE, counts=COUNTS, prior=["vllm"])
    faults: list[tuple[int | None, str, str]] = []
    raw = yaml.safe_load(tune_table.render(rules))["rules"][1]["tuned"]
    evidence = parse_tuned(raw, "rules[1].tuned", 1, lambda line, key, msg: faults.append((line, key, msg)))
    assert not faults and evidence is not None, faults
    assert "measured crossover at 8 tokens: mxfp4_reference up to it, vllm above (worst x1.000 of the fastest" \
        in evidence.summary("vllm"), evidence.summary("vllm")


@pytest.mark.plugin1  # the rules name plugin #1's mxfp4_reference
def test_each_side_without_its_tokens_key_is_a_valid_rule(tmp_path: Path) -> None:
    """The evidence on both rules loads today (real CLI), whatever the tokens key's state."""
    rules, _ = tune_table.tuned_rules(KEY, [decoder(), prefiller()], EVIDENCE, counts=COUNTS, prior=["vllm"])
    for i, rule in enumerate(yaml.safe_load(tune_table.render(rules))["rules"]):
        rule["match"].pop("tokens")
        path = tmp_path / f"side-{i}.yaml"
        path.write_text(yaml.safe_dump({"version": 1, "rules": [rule]}, sort_keys=False))
        out = subprocess.run([str(QUANTREG), "validate", str(path)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr


def test_tune_refuses_bad_token_counts_before_reading_anything(tmp_path: Path) -> None:
    out = subprocess.run([str(QUANTREG), "tune", str(tmp_path / "absent"), "--tokens", "1,abc"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == ("quantreg tune: --tokens 1,abc: abc is not a token count; expected "
                                  "comma-separated whole numbers from 1 to 8192, e.g. 1,2,4,8,16,32,64")


def test_methods_not_timed_at_every_count_keep_the_single_rule() -> None:
    """Results timed at the score's counts only (a table from before --tokens): no split, said why."""
    old = [Result("vllm", ok=True, ms={1: 5.0, 64: 40.0, 256: 70.0}), Result("cpu_mxfp4", ok=True, ms={1: 3.0})]
    rules, decided = tune_table.tuned_rules(KEY, old, EVIDENCE, counts=COUNTS)
    assert [r["method"] for r in rules] == [["vllm"]] and decided.crossover is None
    assert decided.text() == ("no crossover: one method for every token count (vllm); the methods were not timed "
                              "at every count of 1, 2, 4, 8, 16, 32, 64, 128, 256, 512")
    assert decided.to_json()["single_envelope"] is None
