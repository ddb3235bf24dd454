"""The serving bench (bench/serving_bench.py, issue 45) end to end at tiny size: no speed asserted.

It starts vLLM + quantreg's OpenAI server in vLLM's default mode on a 2-layer tiny checkpoint, drives
1 and 2 concurrent streaming clients over a seeded prompt mix, and writes its JSON and table. The
llama-server half runs where ``bench/llama_setup.sh`` built it, else is skipped by name.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest
from core_support import ROOT


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    pytest.importorskip("quantreg_cpu_mxfp4", reason="plugin #2 (plugins/cpu_mxfp4) is not installed")
    tmp = tmp_path_factory.mktemp("serving-bench")
    out = tmp / "result.json"
    proc = subprocess.run([sys.executable, "-m", "bench.serving_bench", "--shape", "tiny", "--layers", "2",
                           "--clients", "1,2", "--requests", "4", "--long-tokens", "48", "--min-out", "4",
                           "--max-out", "8", "--work-dir", str(tmp), "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "| vLLM + quantreg | 1 |" in proc.stdout and "| vLLM + quantreg | 2 |" in proc.stdout
    data: dict[str, object] = json.loads(out.read_text())
    return data


def test_every_level_completes_every_request(result: dict[str, object]) -> None:
    servers = result["servers"]
    assert isinstance(servers, dict)
    vllm = servers["vLLM + quantreg"]
    assert vllm["mode"] == "default" and vllm["startup_s"] > 0
    assert any(" -> " in d for d in vllm["decisions"])
    for level, clients in zip(vllm["levels"], (1, 2), strict=True):
        assert level["clients"] == clients and level["requests"] == 4 and level["errors"] == []
        assert level["output_tok_s"] > 0 and level["requests_s"] > 0
        assert level["ttft_ms_p50"] > 0 and level["itl_ms_p50"] > 0
        assert level["ttft_ms_p99"] >= level["ttft_ms_p50"] and level["itl_ms_p99"] >= level["itl_ms_p50"]
    assert result["machine"]["host_kind"] in ("amx", "avx512", "avx2")  # type: ignore[index]


def test_llama_server_ran_or_was_skipped_by_name(result: dict[str, object]) -> None:
    servers, skipped = result["servers"], result["skipped"]
    assert isinstance(servers, dict) and isinstance(skipped, dict)
    if "llama-server" in skipped:
        assert "llama_server_setup.sh" in skipped["llama-server"] or skipped["llama-server"].startswith("failed")
        assert result["throughput_ratio_vllm_over_llama"] == {}
        return
    assert [lv["errors"] for lv in servers["llama-server"]["levels"]] == [[], []]
    assert set(result["throughput_ratio_vllm_over_llama"]) == {"1", "2"}  # type: ignore[arg-type]


def test_the_plot_draws_every_measured_level(result: dict[str, object], tmp_path: Path) -> None:
    """bench/serving_plot.py turns the run's JSON into the SVG docs/benchmarks.md embeds: one line per
    server in each panel, one point per level, at the level's own numbers (the y scale is checked by
    the ordering of the points: a higher tok/s is drawn higher)."""
    src = tmp_path / "result.json"
    src.write_text(json.dumps(result))
    out = tmp_path / "plot.svg"
    proc = subprocess.run([sys.executable, "-m", "bench.serving_plot", str(src), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    root = ElementTree.fromstring(out.read_text())
    lines = [el for el in root.iter() if el.tag.endswith("polyline")]
    servers = result["servers"]
    assert isinstance(servers, dict)
    assert sorted(el.get("data-series") for el in lines) == sorted(f"{s}, 2 layers" for s in servers for _ in (0, 1))
    for el in lines[:len(lines) // 2]:  # the left panel (output tokens/s) is drawn first
        server = str(el.get("data-series")).rsplit(",", 1)[0]
        ys = [float(p.split(",")[1]) for p in str(el.get("points")).split()]
        toks = [lv["output_tok_s"] for lv in servers[server]["levels"]]
        assert len(ys) == len(toks) == 2
        assert (ys[0] > ys[1]) == (toks[0] < toks[1]) or toks[0] == toks[1]  # SVG y grows downwards
    bad = subprocess.run([sys.executable, "-m", "bench.serving_plot", str(tmp_path / "missing.json"), "--out",
                          str(out)], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode != 0 and "missing.json: not a serving_bench result" in bad.stderr
    assert "Traceback" not in bad.stderr
