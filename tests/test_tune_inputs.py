"""tune on checkpoints its float64 reference cannot compute: one located line each, never a traceback (class 13).

The float64 reference and tune's inputs run outside the containment the methods' builds get, so a
checkpoint whose expert blocks are float32, whose blocks are short for their scales, or whose
``num_experts_per_tok`` exceeds its experts used to end in a torch traceback; an absurd
``num_local_experts`` dropped plan's located problem and said "no MoE layers".
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_tune import TUNE_EACH

from quantreg.tune.command import shape_problem


def _config(d: Path, **changes: Any) -> None:
    config = json.loads((d / "config.json").read_text())
    config.update(changes)
    (d / "config.json").write_text(json.dumps(config))


def _tensors(d: Path, change: Callable[[dict[str, Any]], None]) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


BLOCKS = "model.layers.0.mlp.experts.gate_up_proj_blocks"

#: case -> (how to break the tiny checkpoint, what the one line must say)
CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "expert blocks are float32": (lambda d: _tensors(d, lambda t: t.update({BLOCKS: t[BLOCKS].float()})),
                                  "w13_weight is float32; expected uint8"),
    "blocks short for their scales": (lambda d: _tensors(d, lambda t: t.update({BLOCKS: t[BLOCKS][..., :8]
                                                                                .contiguous()})),
                                      "w13_weight has shape"),
    "num_experts_per_tok exceeds the experts": (lambda d: _config(d, num_experts_per_tok=9),
                                                "num_experts_per_tok is 9; expected 1 to num_local_experts (4)"),
    "num_local_experts absurd": (lambda d: _config(d, num_local_experts=10 ** 30), "num_local_experts"),
    "hidden size not a multiple of 32": (lambda d: _config(d, hidden_size=100), "hidden_size is 100"),
}


def test_shape_problem_says_the_value_and_what_was_expected() -> None:
    assert shape_problem(4, 64, 64, 2) is None
    assert shape_problem(4, 64, 64, 5) == "num_experts_per_tok is 5; expected 1 to num_local_experts (4)"
    assert shape_problem(4, 64, 64, 0) == "num_experts_per_tok is 0; expected 1 to num_local_experts (4)"
    assert shape_problem(0, 64, 64, 1) == "num_local_experts is 0; expected at least 1"
    assert "intermediate_size is 48" in str(shape_problem(4, 64, 48, 2))


@pytest.mark.needs("torch", "vllm")
def test_tune_on_checkpoints_the_reference_cannot_compute(tmp_path: Path) -> None:
    from quantreg.tiny.checkpoint import write_tiny_gpt_oss

    tiny = write_tiny_gpt_oss(tmp_path / "tiny")
    dirs = []
    for n, (make, _) in enumerate(CASES.values()):
        case = tmp_path / f"case{n}"
        case.mkdir()
        for name in ("config.json", "model.safetensors"):
            (case / name).write_bytes((tiny / name).read_bytes())
        make(case)
        dirs.append(str(case))
    proc = subprocess.run([sys.executable, "-c", TUNE_EACH, *dirs], capture_output=True, text=True,
                          timeout=900, stdin=subprocess.DEVNULL)  # ~45 s alone; a loaded host is slower
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    answers = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(answers) == len(CASES)
    for (what, (_, expected)), answer in zip(CASES.items(), answers):
        assert answer["code"] == 1, (what, answer)
        data = json.loads(answer["stdout"])
        assert data["ok"] is False and any(expected in p["text"] for p in data["problems"]), (what, data)
        lines = [line for line in answer["stderr"].splitlines()
                 if line.startswith("quantreg tune: ") and not re.match(r"quantreg tune: \d+s ", line)]
        assert len(lines) == 1 and expected in lines[0] and "Traceback" not in answer["stderr"], (what, answer)
        assert "no MoE layers" not in lines[0], (what, lines)
        assert not (Path(answer["path"]) / "tuned.yaml").exists()
