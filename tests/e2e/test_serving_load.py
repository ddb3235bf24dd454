"""The OpenAI server with quantreg inside, held under concurrent load (issue 45, item 2), vLLM's default mode.

One server (``python -m vllm.entrypoints.openai.api_server``, compiled: no ``--enforce-eager``) on the
tiny GPT-OSS MXFP4 checkpoint, its MoE layers routed by a user table to plugin #2's ``cpu_mxfp4`` (it
runs on every x86-64 kind), ``--max-num-seqs 4`` so that a burst must queue. Bounded in count and
time, loopback only. What must hold:

* **nothing lost**: 8 clients streaming at once each get every token they asked for and ``[DONE]``;
  the greedy tokens of each equal that prompt's tokens served alone, or, where continuous batching
  rounded a near-tie the other way, the served tokens' log-probabilities (teacher-forced, alone)
  are within :data:`LOGPROB_BOUND` of the best token's at the first differing step;
* **a client that disconnects** mid-stream leaves the server serving the others, and the next
  request after them;
* **a burst beyond ``max_num_seqs``** (12 requests against 4 slots) queues: every request answers 200
  with all its tokens;
* **quantreg's lines** stay one decision line per process and key, however many requests came.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from quantreg.testing.serving import REQUEST_TIMEOUT, Server, start_server, stop

pytest.importorskip("quantreg_cpu_mxfp4", reason="plugin #2 (plugins/cpu_mxfp4) is not installed")

MAX_NUM_SEQS = 4
CLIENTS = 8
BURST = 12
MAX_TOKENS = 12
LOGPROB_BOUND = 0.15  # the demo's bound: a near-tie rounded the other way under batching
PROMPTS = [[(13 * i + 7 * c) % 900 + 20 for i in range(6 + 3 * c)] for c in range(CLIENTS)]
TABLE = """\
version: 1
rules:
  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}
    method: cpu_mxfp4
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from quantreg.tiny.command import write_tiny_model

    work = tmp_path_factory.mktemp("serving-load")
    model = write_tiny_model(work / "tiny")
    (work / "table.yaml").write_text(TABLE, encoding="utf-8")
    started = start_server(model, work, ("--max-num-seqs", str(MAX_NUM_SEQS)),
                           {"QUANTREG_CONFIG": str(work / "table.yaml")})
    try:
        assert started.healthy, f"not healthy after {started.startup_s:.0f}s:\n{started.log[-6000:]}"
        yield started
    finally:
        stop(started.proc)


def _body(server: Server, prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}


def _stream_tokens(server: Server, prompt: list[int]) -> tuple[list[int], bool]:
    """Stream one completion; (token ids in order, whether ``[DONE]`` closed it)."""
    events = server.stream("/v1/completions", _body(server, prompt))
    tokens = [t for e in events[:-1] if isinstance(e, dict) for c in e.get("choices", [])
              for t in (c.get("token_ids") or [])]
    return tokens, events[-1] == "[DONE]"


@pytest.fixture(scope="module")
def alone(server: Server) -> list[list[int]]:
    """Each prompt's greedy tokens, served alone (one request at a time)."""
    return [server.post("/v1/completions", _body(server, p))["choices"][0]["token_ids"] for p in PROMPTS]


def _near_tie(server: Server, prompt: list[int], alone: list[int], served: list[int]) -> str | None:
    """None if ``served`` equals ``alone``, or first differs where both tokens were (alone, teacher-forced)
    within the bound of each other; else why not."""
    step = next((i for i, (a, b) in enumerate(zip(alone, served, strict=True)) if a != b), None)
    if step is None:
        return None
    scored = server.post("/v1/completions", {"model": server.model, "prompt": prompt + alone[:step], "max_tokens": 1,
                                             "temperature": 0, "logprobs": 20, "ignore_eos": True,
                                             "return_token_ids": True})
    top = scored["choices"][0]["logprobs"]["top_logprobs"][0]
    values = sorted(top.values(), reverse=True)
    if len(values) < 2 or values[0] - values[1] > LOGPROB_BOUND:
        return f"step {step}: alone {alone[step]}, batched {served[step]}, top logprobs {values[:3]}"
    return None


def test_concurrent_streams_all_complete_with_the_tokens_served_alone(server: Server, alone: list[list[int]]) -> None:
    with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
        results = list(pool.map(lambda p: _stream_tokens(server, p), PROMPTS))
    problems = []
    for prompt, want, (got, done) in zip(PROMPTS, alone, results, strict=True):
        assert done and len(got) == MAX_TOKENS, (got, done)
        why = _near_tie(server, prompt, want, got)
        if why is not None:
            problems.append(why)
    assert not problems, problems
    print(f"concurrent: {CLIENTS} streams, tokens equal to alone for "
          f"{sum(w == g for w, (g, _) in zip(alone, results))}/{CLIENTS}")


def test_clients_that_disconnect_leave_the_others_served(server: Server, alone: list[list[int]]) -> None:
    dropped: list[int] = []

    def drop(prompt: list[int]) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_TIMEOUT)
        body = json.dumps({**_body(server, prompt, max_tokens=200), "stream": True})
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        resp.readline()  # the first event arrived: the request is being served
        dropped.append(1)
        conn.close()  # gone mid-stream

    keeper: list[tuple[list[int], bool]] = []
    threads = [threading.Thread(target=drop, args=(PROMPTS[i],)) for i in range(3)]
    threads.append(threading.Thread(target=lambda: keeper.append(_stream_tokens(server, PROMPTS[3]))))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=REQUEST_TIMEOUT * 2)
    assert len(dropped) == 3 and keeper and keeper[0][1] and len(keeper[0][0]) == MAX_TOKENS
    after = server.post("/v1/completions", _body(server, PROMPTS[0]))["choices"][0]["token_ids"]
    assert after == alone[0]  # alone again: the same greedy tokens as before the disconnects


def test_a_burst_beyond_max_num_seqs_queues_and_every_request_answers(server: Server) -> None:
    def one(i: int) -> tuple[int, int]:
        reply = server.post("/v1/completions", _body(server, PROMPTS[i % CLIENTS]))
        return len(reply["choices"][0]["token_ids"]), reply["usage"]["completion_tokens"]

    with ThreadPoolExecutor(max_workers=BURST) as pool:
        answers = list(pool.map(one, range(BURST)))
    assert answers == [(MAX_TOKENS, MAX_TOKENS)] * BURST


def test_quantreg_lines_stay_one_per_process_and_key(server: Server, alone: list[list[int]]) -> None:
    lines = [ln for ln in server.log.splitlines() if "quantreg: (gpt_oss_mxfp4, gpt_oss, cpu) -> " in ln]
    pids = [m.group(1) for ln in lines if (m := re.search(r"pid=(\d+)\)", ln))]
    assert lines and len(pids) == len(set(pids)), lines  # one line per process, requests add none
    assert all("-> cpu_mxfp4 [" in ln for ln in lines), lines
    assert Path(server.log_path).stat().st_size < 5_000_000  # no per-request logging from quantreg
