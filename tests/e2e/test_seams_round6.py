"""Issue 53's acceptance on real vLLM-CPU servers, in vLLM's default (compiled) mode, lenient.

* **Class 1**: a ``layer: dense`` rule on GPT-OSS's router (``model.layers.N.mlp.router``, built by
  vLLM as a ``GateLinear``, a ``ReplicatedLinear``) serves in vLLM's default mode. The op's fake
  used to size the output from ``output_size_per_partition``, which a replicated layer does not
  set: the compile failed. The method is plugin #3's own int8 kernel (``cpu_int8_dense_kernel``,
  AVX2+FMA: every host kind the project supports).
* **Class 2**: a user table whose winning rule gives ``cpu_mxfp4`` an option value it refuses
  (``precision: q4``) and whose next rule names ``mxfp4_reference``: the layers are served by
  ``mxfp4_reference`` with exactly one WARNING (naming the method, its plugin and distribution, the
  fault and what serves), and EngineCore does not die. On a CPU without AMX vLLM's own MXFP4
  method cannot build, so falling back to it (as before) took the engine down.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import MXFP4_KEY

from quantreg.testing.serving import Server, start_server, stop

pytest.importorskip("quantreg_hpu_mxfp4", reason="plugin #1 (plugins/hpu_mxfp4) is not installed")
pytest.importorskip("quantreg_cpu_mxfp4", reason="plugin #2 (plugins/cpu_mxfp4) is not installed")
pytest.importorskip("quantreg_cpu_int8_dense", reason="plugin #3 (plugins/cpu_int8_dense) is not installed")

TABLES = {
    "router": "version: 1\nrules:\n  - match: {layer: dense}\n    method: cpu_int8_dense_kernel\n",
    "refused_option": ("version: 1\nrules:\n"
                       f"  - match: {{{MXFP4_KEY}}}\n    method: cpu_mxfp4\n    options: {{precision: q4}}\n"
                       "  - match: {quant_format: gpt_oss_mxfp4}\n    method: mxfp4_reference\n"),
}
#: Lines about how long a plugin call took (the watchdog's "still ..." / "took ..."): a report of this
#: shared machine's load, not of the table; every other quantreg WARNING counts.
SLOWNESS = re.compile(r"quantreg: (still .* after [0-9.]+ s|.* took [0-9.]+ s)$")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quantreg.tiny.command import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("round6-mxfp4"))


@pytest.fixture(scope="module", params=sorted(TABLES))
def served(request: pytest.FixtureRequest, model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Server]]:
    case = request.param
    work = tmp_path_factory.mktemp(f"round6-{case}")
    table = work / f"{case}.yaml"
    table.write_text(TABLES[case], encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:  # vLLM's defaults untouched (tests/conftest.py sets this one)
        mp.delenv("VLLM_USE_AOT_COMPILE", raising=False)
        server = start_server(model, work, (), {"QUANTREG_CONFIG": str(table)})
    try:
        assert server.healthy, (f"{case}: not healthy in default mode after {server.startup_s:.0f}s "
                                f"(exit {server.returncode}); log tail:\n{server.log[-6000:]}")
        assert "--enforce-eager" not in " ".join(server.proc.args)  # type: ignore[arg-type]
        yield case, table, server
    finally:
        stop(server.proc)


def _quantreg_warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if "WARNING" in line and "quantreg: " in line
            and not SLOWNESS.search(line.rstrip())]


def test_serves_in_default_mode_as_the_table_says(served: tuple[str, Path, Server]) -> None:
    case, table, server = served
    log = server.log
    if case == "router":
        assert "quantreg: (gpt_oss_mxfp4, gpt_oss, cpu, dense) -> cpu_int8_dense_kernel [" in log, log[-6000:]
        assert not _quantreg_warnings(log), _quantreg_warnings(log)
    else:
        warnings = _quantreg_warnings(log)
        assert len(warnings) == 1, warnings
        (line,) = warnings
        assert (f"quantreg: method 'cpu_mxfp4' (plugin 'cpu_mxfp4', distribution quantreg-cpu-mxfp4) for "
                f"(gpt_oss_mxfp4, gpt_oss, cpu) [{table}:3] could not be built: ValueError: ") in line, line
        assert "precision='q4'" in line and line.endswith(
            f"using 'mxfp4_reference' [{table}:6], the next method known to run here"), line
        assert "EngineCore failed" not in log and "EngineDeadError" not in log
    assert "Traceback" not in log, log[-6000:]
    done = server.post("/v1/completions", {"model": server.model, "prompt": "Hello, my name is", "max_tokens": 5,
                                           "temperature": 0, "ignore_eos": True})
    assert done["choices"][0]["text"] and done["usage"]["completion_tokens"] == 5
    chat = server.post("/v1/chat/completions", {"model": server.model, "max_tokens": 4, "temperature": 0,
                                                "messages": [{"role": "user", "content": "Hello"}]})
    assert chat["usage"]["completion_tokens"] >= 1
    assert server.proc.poll() is None  # still serving: nothing took the engine down
