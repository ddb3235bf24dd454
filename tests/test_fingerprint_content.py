"""Fingerprints are content, not install paths (issue 22 class 1).

Two installs of the same quantreg + plugin #1 at different paths (each a copy of the installed
files: packages and their dist-info, what ``pip install --target`` writes), each run in an isolated
interpreter that sees only its own copy, with one user table kept at two different paths: one
fingerprint. Editing the table changes it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import quantreg

SITE = Path(quantreg.__file__).resolve().parent.parent
COPIED = ("quantreg", "quantreg-*.dist-info", "quantreg_hpu_mxfp4", "quantreg_hpu_mxfp4-*.dist-info",
          "pluggy", "pluggy-*.dist-info", "yaml", "_yaml", "[Pp]y[Yy][Aa][Mm][Ll]-*.dist-info")
PROBE = ("import json, sys; sys.path[:0] = [sys.argv[1]]; from quantreg.registry import get_registry; "
         "r = get_registry(); print(json.dumps({'fp': r.fingerprint(), 'tables': [t.path for t in r.tables], "
         "'file': __import__('quantreg').__file__}))")
TABLE = "version: 1\nrules:\n  - match: {quant_format: gpt_oss_mxfp4, device: cpu}\n    method: mxfp4_reference\n"


def install_copy(root: Path) -> Path:
    root.mkdir(parents=True)
    for pattern in COPIED:
        for item in SITE.glob(pattern):
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, root / item.name)
    return root


def fingerprint(site: Path, table: Path) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    env["QUANTREG_CONFIG"] = str(table)
    done = subprocess.run([sys.executable, "-I", "-S", "-c", PROBE, str(site)], env=env, capture_output=True,
                          text=True, timeout=120, cwd=site)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    assert str(result["file"]).startswith(str(site))  # this copy, not the venv's
    return result


def _why_no_copy() -> str | None:
    """Why two copies of the installed files cannot be made here (``None``: they can)."""
    import importlib.util

    if importlib.util.find_spec("quantreg_hpu_mxfp4") is None:
        return "plugin #1 is not installed"
    if not any(SITE.glob("quantreg_hpu_mxfp4")):
        return "copies wheel-installed files: quantreg and plugin #1 are editable installs here (pip install -e)"
    return None


@pytest.mark.skipif(_why_no_copy() is not None, reason=str(_why_no_copy()))
def test_two_installs_at_different_paths_give_one_fingerprint(tmp_path: Path) -> None:
    one, two = install_copy(tmp_path / "node-a" / "site"), install_copy(tmp_path / "elsewhere" / "b" / "lib")
    (tmp_path / "etc").mkdir()
    table_a, table_b = tmp_path / "etc" / "moe.yaml", tmp_path / "b-table.yaml"
    table_a.write_text(TABLE)
    table_b.write_text(TABLE)
    a, b = fingerprint(one, table_a), fingerprint(two, table_b)
    assert any("quantreg_hpu_mxfp4" in p for p in a["tables"])  # type: ignore[attr-defined]
    assert a["tables"] != b["tables"]  # different install paths and table paths ...
    assert a["fp"] == b["fp"]  # ... one fingerprint
    table_b.write_text(TABLE.replace("device: cpu", "device: hpu"))
    assert fingerprint(two, table_b)["fp"] != a["fp"]  # the content counts


def test_packaged_tables_are_named_relative_to_their_distribution() -> None:
    from quantreg.table.identity import package_name, table_names

    shipped = str(Path(quantreg.__file__).parent / "registry.yaml")
    assert package_name(shipped) == "quantreg:quantreg/registry.yaml"
    assert table_names([(shipped, "builtin"), ("/x/a.yaml", "user"), ("/y/b.yaml", "user")]) == {
        shipped: "quantreg:quantreg/registry.yaml", "/x/a.yaml": "user#0", "/y/b.yaml": "user#1"}


def test_doctor_warns_when_a_source_tree_in_the_cwd_shadows_this_copy(tmp_path: Path) -> None:
    """``python -m vllm...`` started in a clone's root imports ``./quantreg``, the command the installed one."""
    from quantreg.installed import shadowing_copy

    assert shadowing_copy(str(tmp_path)) is None  # nothing to shadow
    (tmp_path / "quantreg").mkdir()
    (tmp_path / "quantreg" / "__init__.py").write_text("")
    warning = shadowing_copy(str(tmp_path))
    assert warning is not None and str(tmp_path / "quantreg") in warning and "python -m vllm" in warning
    this_copy = Path(quantreg.__file__).resolve().parent.parent
    assert shadowing_copy(str(this_copy)) is None  # the copy in use is not a shadow of itself


def test_the_owner_lookup_agrees_with_the_full_metadata_scan() -> None:
    """``identity._owners`` reads only the distributions named like the package (issue 24.7: the full
    ``packages_distributions()`` scan cost ~250 ms of every vLLM process's ``register()``); for every
    package a table can ship in here, and for names no distribution is named after, it gives what
    the full scan gives."""
    from importlib import metadata

    from quantreg.table import identity

    full = metadata.packages_distributions()
    editable = {n: v for n, v in {"quantreg": "quantreg", "quantreg_hpu_mxfp4": "quantreg-hpu-mxfp4",
                                  "quantreg_cpu_mxfp4": "quantreg-cpu-mxfp4"}.items()
                if n not in full and _editable(v)}
    full = {**full, **{n: [v] for n, v in editable.items()}}  # what an editable install's .pth provides
    names = ["quantreg", "quantreg_hpu_mxfp4", "quantreg_cpu_mxfp4", "pluggy", "yaml", "no_such_package_here"]
    for name in names:
        identity._owners.cache_clear()
        assert identity._owners(name) == tuple(sorted(set(full.get(name, ())))), name
    assert identity._owners("quantreg") == ("quantreg",)


def _editable(dist: str) -> bool:
    """Is ``dist`` installed with ``pip install -e`` (PEP 610 ``direct_url.json``: ``dir_info.editable``)?"""
    from importlib import metadata

    try:
        text = metadata.distribution(dist).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return False
    return bool(text) and bool(json.loads(text).get("dir_info", {}).get("editable"))


def test_operator_tables_are_named_by_position_wherever_they_are() -> None:
    from quantreg.table.identity import table_names

    shipped = str(Path(quantreg.__file__).parent / "registry.yaml")
    assert table_names([(shipped, "user"), (shipped + ".run", "run")]) == {shipped: "user#0", shipped + ".run": "run#0"}
