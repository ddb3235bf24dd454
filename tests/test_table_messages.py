"""Messages of issue 53, class 6: every refusal is located and says what it refused, in its own words.

A 5,000-digit number anywhere a table or ``tune --tokens`` takes one is "too large (N digits)",
never Python's text about its 4,300-digit limit; ``decoders: []`` says it got an empty list; a
flag list names the item that is not a flag. Each case is a real table file through ``quantreg
validate`` (in this process), and the line it prints is compared whole.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from quantreg.cli import main
from quantreg.tune.command import parse_tokens

pytestmark = pytest.mark.usefixtures("clean_env")

HUGE = "9" * 5000
MATCH = "{quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}"

#: case -> (the rule's extra lines, the key path in the message, what the message must say after it)
TABLE_CASES: dict[str, tuple[str, str, str]] = {
    "priority huge": (f"    priority: {HUGE}\n", "rules[0]",
                      "integer too large (5,000 digits); tables hold small numbers"),
    "priority huge negative": (f"    priority: -{HUGE}\n", "rules[0]",
                               "integer too large (5,000 digits); tables hold small numbers"),
    "verify every huge": (f"    verify: {{against: float64, every: {HUGE}}}\n", "rules[0]",
                          "integer too large (5,000 digits); tables hold small numbers"),
    "decoders empty": ("    verify: {against: float64, decoders: []}\n", "rules[0].verify.decoders",
                       "got an empty list"),
    "cpu_flags item": ("    tuned:\n      results: [{method: vllm, ok: true, ms: {1: 1.0}}]\n"
                       "      pins: {cpu_flags: [avx2, 5]}\n", "rules[0].tuned.pins.cpu_flags",
                       "item 2 (integer 5) is not one of the CPU flag names: expected a string"),
    "cpu_flags spaced item": ("    tuned:\n      results: [{method: vllm, ok: true, ms: {1: 1.0}}]\n"
                              "      pins: {cpu_flags: [avx2, 'avx 512']}\n", "rules[0].tuned.pins.cpu_flags",
                              "item 2 (string 'avx 512') is not one of the CPU flag names"),
}


@pytest.mark.parametrize("case", sorted(TABLE_CASES))
def test_a_table_value_is_refused_in_its_own_words(case: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    extra, where, expected = TABLE_CASES[case]
    path = tmp_path / "t.yaml"
    path.write_text(f"version: 1\nrules:\n  - match: {MATCH}\n    method: vllm\n{extra}")
    assert main(["validate", str(path)]) == 1
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"{path}:") and f": {where}" in out and expected in out, out
    assert "4300" not in out and "Exceeds the limit" not in out and "\n" not in out, out
    assert not out.rstrip().endswith("got list"), out


@pytest.mark.parametrize("text", [f"1,{HUGE}", HUGE, f"{HUGE},8"])
def test_a_huge_tokens_item_is_too_large_with_its_digit_count(text: str) -> None:
    counts, problem = parse_tokens(text)
    assert counts is None and problem is not None
    assert "is too large (5,000 digits)" in problem and "4300" not in problem and len(problem) < 300, problem


def test_the_tune_command_says_so_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["tune", str(tmp_path), "--tokens", f"1,{HUGE}"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "--tokens" in err and "too large (5,000 digits)" in err and "4300" not in err, err
