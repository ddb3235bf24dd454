"""The README's commands, run: the opt-in table named by `python -m quantreg_cpu_int8_dense` turns the
method on for the lm_head key, and without it the same key keeps vLLM's own method."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from quantreg.host import host_facts, simulate

README = Path(__file__).resolve().parent.parent / "README.md"
BIN = Path(sys.executable).parent


def _shell(command: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    base["PATH"] = f"{BIN}{os.pathsep}{base.get('PATH', '')}"
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, env={**base, **env}, timeout=300)


def _onednn_table(tmp: Path) -> Path:
    path = tmp / "onednn.yaml"
    path.write_text("version: 1\nrules:\n  - match: {model_type: gpt_oss, device: cpu, layer: [attention, lm_head]}\n"
                    "    method: cpu_int8_dense\n")
    return path


def test_readme_explain_command_and_the_opt_in(tmp_path: Path) -> None:
    commands = re.findall(r"^\$ (.+)$", README.read_text(), re.MULTILINE)
    explain = [c for c in commands if "quantreg explain" in c]
    assert len(explain) == 1 and "QUANTREG_CONFIG=$(python -m quantreg_cpu_int8_dense)" in explain[0]
    done = _shell(explain[0])
    assert done.returncode == 0, done.stderr
    # the plugin's own kernel on every x86-64 kind (its AVX2 path does not saturate)
    assert done.stdout.splitlines()[:2] == ["key      (gpt_oss_mxfp4, gpt_oss, cpu, lm_head)",
                                            "method   cpu_int8_dense_kernel"]
    # the price beside the name (issue 54): the method's declared numerics
    assert ("numerics cpu_int8_dense_kernel: weights int8 per (output row, 32-block along K) with fp16 scales"
            in done.stdout), done.stdout
    avx2 = _shell(explain[0], **simulate("avx2"))
    assert avx2.returncode == 0 and avx2.stdout.splitlines()[1] == "method   cpu_int8_dense_kernel", avx2.stdout
    # vLLM's oneDNN int8 alone: chosen with VNNI; without it (real, or simulated) passed over, and
    # explain says why (issue 46, class 3)
    onednn = explain[0].replace("$(python -m quantreg_cpu_int8_dense)", str(_onednn_table(tmp_path)))
    facts = host_facts()
    vnni = facts.has("avx512_vnni") or facts.has("avx_vnni")
    here = _shell(onednn)
    assert here.stdout.splitlines()[1] == f"method   {'cpu_int8_dense' if vnni else 'vllm'}", here.stdout + here.stderr
    avx2 = _shell(onednn, **simulate("avx2"))
    assert avx2.returncode == 0 and "method   vllm" in avx2.stdout.splitlines()[1], avx2.stdout + avx2.stderr
    assert "  no  cpu_int8_dense: passed over: needs cpu flag avx512_vnni or avx_vnni, this host has an avx2 " \
           "CPU (flags: avx2, fma); flags simulated by QUANTREG_HOST_CPU_FLAGS" in avx2.stdout.splitlines(), avx2.stdout
    plain = _shell(explain[0].split(") ", 1)[1])  # the same command without the table: vLLM's own method
    assert plain.returncode == 0, plain.stderr
    assert "method   vllm" in plain.stdout.splitlines()[1]


def test_the_shipped_table_holds_the_readme_rule() -> None:
    from quantreg_cpu_int8_dense.plugin import table_path

    shipped = table_path().read_text()
    assert "match: {model_type: gpt_oss, device: cpu, layer: [attention, lm_head]}" in shipped
    assert "match: {model_type: gpt_oss, device: cpu, layer: [attention, lm_head]}" in README.read_text()
    chain = "method: cpu_int8_dense_kernel\n"
    assert chain in shipped and chain in README.read_text()
    # vLLM's oneDNN int8 GEMM (per-token activations) is in no shipped chain: it cannot meet Q8_0's error
    assert "method: [cpu_int8_dense_kernel, cpu_int8_dense]" not in shipped
