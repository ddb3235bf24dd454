"""``quantreg new-plugin NAME [DIR]`` writes a plugin that installs, is listed and validates as written.

Real parts only: the installed ``quantreg`` command writes the skeleton, ``pip`` builds and installs
it (``--target``, as tests/e2e/test_walkthrough.py installs the example) and fresh ``quantreg``
processes find it through its real entry point. The method template is the worked example of
docs/writing-a-plugin.md with its names as placeholders; a test holds the two equal, so the
scaffold cannot drift from the page's tested code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantreg.newplugin import names, render

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "quantreg-example-plugin"


def quantreg(*args: str, cwd: Path, site: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run([sys.executable, "-m", "quantreg", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("new-plugin")
    proc = quantreg("new-plugin", "demo_x", cwd=work)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    assert "pip install -e 'quantreg-demo-x[test]'" in proc.stdout
    return work / "quantreg-demo-x"  # the default DIR


@pytest.fixture(scope="module")
def site(written: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("demo-x-site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                           str(target), str(written)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def test_every_file_is_there_with_the_name_substituted(written: Path) -> None:
    files = sorted(str(p.relative_to(written)) for p in written.rglob("*") if p.is_file())
    assert files == ["README.md", "pyproject.toml", "quantreg_demo_x/__init__.py", "quantreg_demo_x/method.py",
                     "quantreg_demo_x/plugin.py", "quantreg_demo_x/rules.yaml",
                     "tests/test_quantreg_conformance.py"]
    for path in written.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert "__NAME__" not in text and "__PACKAGE__" not in text and "__CLASS__" not in text, path
            assert "example" not in text.replace("worked example", ""), path  # no leftover of the copy
    pyproject = (written / "pyproject.toml").read_text()
    assert 'name = "quantreg-demo-x"' in pyproject
    assert '[project.entry-points.quantreg]\ndemo_x = "quantreg_demo_x.plugin"' in pyproject
    assert "class DemoXMoEMethod(FusedMoEMethodBase)" in (written / "quantreg_demo_x" / "method.py").read_text()
    assert '@pytest.mark.quantreg_method("demo_x")' in (written / "tests" / "test_quantreg_conformance.py").read_text()
    assert "pip install -e '.[test]'" in (written / "README.md").read_text()


@pytest.mark.needs("torch", "vllm")  # the scaffold's method requires both to be available (skip contract)
def test_installed_it_is_listed_and_its_table_validates(site: Path, tmp_path: Path) -> None:
    listed = quantreg("list", "--json", cwd=tmp_path, site=site)
    assert listed.returncode == 0, listed.stderr
    methods = {m["name"]: m for m in json.loads(listed.stdout)["methods"]}
    assert methods["demo_x"]["target"] == "quantreg_demo_x.method:DemoXMoEMethod", methods["demo_x"]
    assert methods["demo_x"]["plugin"] == "demo_x"
    valid = quantreg("validate", str(site / "quantreg_demo_x" / "rules.yaml"), cwd=tmp_path, site=site)
    assert valid.returncode == 0, valid.stdout + valid.stderr
    explained = quantreg("explain", "gpt_oss_mxfp4", "gpt_oss", "cpu", "--json", cwd=tmp_path, site=site)
    decision = json.loads(explained.stdout)
    mine = [c for c in decision["candidates"] if c["rule"]["path"].endswith("quantreg_demo_x/rules.yaml")]
    assert mine and mine[0]["rule"]["tier"] == "plugin" and mine[0]["rule"]["priority"] == -10, decision
    others = [c for c in decision["candidates"] if c["rule"]["tier"] == "plugin" and c not in mine]
    if others:  # another installed plugin's packaged rule decides this key: the scaffold does not take it
        assert not mine[0]["won"] and "lower priority" in mine[0]["reason"], decision
        doctor = quantreg("doctor", cwd=tmp_path, site=site).stdout
        said = [ln for ln in doctor.splitlines() if "takes keys matching" in ln and "quantreg_demo_x" in ln]
        assert len(said) == 1 and f"{others[0]['rule']['path']}:{others[0]['rule']['line']}" in said[0], doctor
    else:
        assert decision["method"] == "demo_x" and mine[0]["won"], decision
    # complete: plan has no warning about it (it declares expert_layout)
    layout = subprocess.run([sys.executable, "-c", "import quantreg; "
                             "print(quantreg.Registry.build(env={}).methods['demo_x'].expert_layout)"],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(site)}, timeout=120)
    assert layout.stdout.strip() == "bf16", layout.stdout + layout.stderr
    # The hooks module is what every vLLM process imports: it must not pull in torch or vLLM.
    light = subprocess.run([sys.executable, "-c", "import sys, quantreg_demo_x.plugin; "
                            "assert not {'torch', 'vllm'} & set(sys.modules), sorted(sys.modules)"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(site)}, timeout=120)
    assert light.returncode == 0, light.stderr


def test_the_method_template_is_the_tested_example() -> None:
    """The example (installed, checked and run in vLLM by test_walkthrough) under the name example_mxfp4."""
    files = render("example_mxfp4")
    package = names("example_mxfp4")["__PACKAGE__"]
    for relative, example in (("method.py", "quantreg_example_plugin/method.py"),
                              ("../tests/test_quantreg_conformance.py", "tests/test_quantreg_conformance.py")):
        key = str(Path(package, relative)) if not relative.startswith("..") else relative[3:]
        assert files[key].replace(package, "quantreg_example_plugin") == (EXAMPLE / example).read_text(), key


@pytest.mark.parametrize("name", ["Demo", "1x", "a-b", "x__y", "x_", "class", "vllm", "a" * 41, ""])
def test_an_invalid_name_is_one_line_and_writes_nothing(name: str, tmp_path: Path) -> None:
    proc = quantreg("new-plugin", name, str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 1 and not proc.stdout
    assert proc.stderr.startswith(f"quantreg new-plugin: invalid plugin name '{name}': ")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_non_empty_directory_is_refused_in_one_line(tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    proc = quantreg("new-plugin", "demo_x", str(target), cwd=tmp_path)
    assert proc.returncode == 1 and not proc.stdout
    assert proc.stderr == f"quantreg new-plugin: {target}: is not empty; choose a new or empty directory " \
                          "(nothing was written)\n"
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert quantreg("new-plugin", "demo_x", str(empty), "--json", cwd=tmp_path).returncode == 0
    assert (empty / "quantreg_demo_x" / "plugin.py").is_file()
