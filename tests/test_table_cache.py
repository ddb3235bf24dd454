"""The parse cache for package tables: same documents and lines, no PyYAML at start-up, never fatal.

Also here (issue 24 class 5): cache-entry integrity (checksums, bypass, a FIFO at the entry path), from
test_containment_loader.py (issue 12, loader classes) (classes 3 and 11).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from core_support import run_cli, write

from quantreg import settings
from quantreg.table import cache as tablecache
from quantreg.table.file import Tier, parse_table, read_table
from quantreg.table.located import LocatedDict, LocatedList, from_json, to_json
from quantreg.table.yamlfile import parse

pytestmark = pytest.mark.usefixtures("clean_env")

DOC = """\
version: 1
strict: false
rules:
  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: hpu}
    method: [a, b]
    options: {x: 1.5, y: .nan, z: -0.0, "on": yes, 3: null, big: 123456789012345678901234567890}
  - match:
      quant_format: '*'
    method:
      - vllm
"""

VALID = DOC.replace("[a, b]", "vllm").replace("3: null, ", "").replace("y: .nan, ", "")  # no problems, no NaN


def same_located(a: Any, b: Any) -> bool:
    """Equal values, types, key order, and lines everywhere (NaN equal to NaN)."""
    if isinstance(a, LocatedDict):
        return (isinstance(b, LocatedDict) and a.line == b.line
                and list(a.key_lines.items()) == list(b.key_lines.items())
                and list(a) == list(b) and all(same_located(a[k], b[k]) for k in a))
    if isinstance(a, LocatedList):
        return (isinstance(b, LocatedList) and a.line == b.line and a.item_lines == b.item_lines
                and len(a) == len(b) and all(same_located(x, y) for x, y in zip(a, b)))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b))


def test_json_form_round_trips_values_types_and_lines() -> None:
    doc = parse(DOC)
    again = from_json(json.loads(json.dumps(to_json(doc))))
    assert same_located(doc, again)
    assert again["rules"].item_lines == [4, 7] and again["rules"][0].key_lines["options"] == 6


@pytest.mark.parametrize("bad", [
    {"d": 1}, {"d": "1", "k": []}, {"l": 1, "i": [[1]]}, {"d": 1, "k": [[{"d": 1, "k": []}, 1, 2]]},
    {"d": 1, "k": [["a", 1, 1], ["a", 2, 2]]}, [1, 2], {"x": 1},
])
def test_corrupt_json_forms_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError):
        from_json(bad)


def test_package_layers_are_cached_and_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path / "cache"))
    path = write(tmp_path / "plugin.yaml", VALID)
    first, problems, _ = read_table(path, Tier.PLUGIN)
    entries = list((tmp_path / "cache" / "tables").glob("*.json"))
    assert len(entries) == 1 and problems == []
    second, again, _ = read_table(path, Tier.PLUGIN)
    assert first == second and again == []
    # The entry is what was read the second time: change it *with a valid checksum*, and the change shows.
    data = tablecache.read_entry(entries[0])
    assert data is not None
    data["k"][0][2] = 1  # version: 1 (unchanged) ...
    data["k"][1][2] = True  # ... strict: true
    entries[0].write_bytes(tablecache.encode_entry(entries[0].name, data))
    third, _, _ = read_table(path, Tier.PLUGIN)
    assert third is not None and third.strict is True


def test_problems_keep_their_lines_through_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path / "cache"))
    text = "version: 1\nrules:\n  - match: {quant_format: mxfp4}\n    methodz: [vllm]\n"
    path = write(tmp_path / "plugin.yaml", text)
    _, fresh, _ = read_table(path, Tier.PLUGIN)
    assert len(list((tmp_path / "cache" / "tables").glob("*.json"))) == 1
    _, cached, _ = read_table(path, Tier.PLUGIN)
    assert [str(p) for p in fresh] == [str(p) for p in cached] and fresh and fresh[0].line == 4


def test_operator_tables_and_broken_files_are_never_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path / "cache"))
    user = write(tmp_path / "user.yaml", DOC)
    for layer in (Tier.USER, Tier.RUN):
        read_table(user, layer)
    broken = write(tmp_path / "broken.yaml", "version: 1\nrules: [\n")
    _, problems, _ = read_table(broken, Tier.DEFAULT)
    assert problems and problems[0].line == 3 and "YAML syntax error" in problems[0].message
    assert not (tmp_path / "cache").exists()


def test_corrupt_or_unwritable_cache_never_fails_a_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "default.yaml", VALID)
    expected, _, _ = read_table(path, Tier.DEFAULT)  # cache elsewhere (the default location or off)
    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path / "cache"))
    entry = tablecache.entry_path(path.read_text())
    assert entry is not None
    entry.parent.mkdir(parents=True)
    entry.write_text('{"d": 1, "k": [[')  # truncated
    table, problems, _ = read_table(path, Tier.DEFAULT)
    assert table == expected and problems == []
    rewritten = tablecache.read_entry(entry)
    assert rewritten is not None and rewritten["d"] == 1  # rewritten whole, with its checksum
    blocker = write(tmp_path / "not-a-dir", "")
    monkeypatch.setenv(settings.CACHE_DIR, str(blocker))  # the cache "directory" is a file: cannot write
    table, problems, _ = read_table(path, Tier.DEFAULT)
    assert table == expected and problems == []
    monkeypatch.setenv(settings.CACHE_DIR, "off")
    assert tablecache.directory() is None and tablecache.entry_path("x") is None


@pytest.mark.plugin1
def test_warm_cache_means_no_yaml_import_at_registration(tmp_path: Path) -> None:
    """A real start-up: ``register()`` in fresh processes, first filling the cache, then using it."""
    probe = ("import sys, quantreg.vllm as v; v.register(); "
             "from quantreg.registry import get_registry; r = get_registry(); "
             "print('yaml' in sys.modules, len(r.tables), len(r.problems))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}

    def run(cache: str) -> tuple[str, list[str]]:
        proc = subprocess.run([sys.executable, "-c", probe], env={**env, settings.CACHE_DIR: cache},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        yaml_imported, *counts = proc.stdout.split()
        return yaml_imported, counts

    cache = str(tmp_path / "cache")
    cold, cold_counts = run(cache)
    warm, warm_counts = run(cache)
    off, off_counts = run("off")
    assert (cold, warm, off) == ("True", "False", "True")
    assert cold_counts == warm_counts == off_counts and int(cold_counts[0]) >= 2  # default + plugin tables, no problems
    assert cold_counts[1] == "0"
    assert len(list(Path(cache, "tables").glob("*.json"))) == int(cold_counts[0])


# -- from test_containment_loader.py (issue 12, loader classes) -------------------------------


def test_a_fifo_at_the_cache_entry_path_does_not_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from quantreg.table import cache as tablecache

    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path / "cache"))
    text = "version: 1\nrules:\n  - match: {}\n    method: vllm\n"
    entry = tablecache.entry_path(text)
    assert entry is not None
    entry.parent.mkdir(parents=True)
    os.mkfifo(entry)
    os.mkfifo(entry.with_name(f".{entry.name}.{os.getpid()}.tmp"))  # and at the temporary name a writer uses
    table, problems, _ = parse_table(text, "pkg.yaml", Tier.DEFAULT)
    assert problems == [] and table is not None and len(table.rules) == 1


def _default_entry(cache: Path) -> Path:
    from quantreg.builtin import default_table_path
    from quantreg.table import cache as tablecache

    os.environ[settings.CACHE_DIR] = str(cache)
    try:
        entry = tablecache.entry_path(Path(default_table_path()).read_text(encoding="utf-8"))
    finally:
        del os.environ[settings.CACHE_DIR]
    assert entry is not None
    return entry


def _rename_vllm(data: Any) -> Any:
    """The default table's JSON with every method name 'vllm' changed: different, valid located JSON."""
    return json.loads(json.dumps(data).replace('"vllm"', '"vllm_renamed"'))


def _cli_env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")}
    return {**env, "QUANTREG_PLUGINS": "", "QUANTREG_CACHE_DIR": str(cache)}


def test_an_entry_corrupted_into_other_valid_json_is_not_trusted(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from quantreg.table import cache as tablecache

    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path / "cache"))
    path = tmp_path / "plugin.yaml"
    path.write_text("version: 1\nrules:\n  - match: {device: cpu}\n    method: vllm\n")
    fresh, _, _ = read_table(path, Tier.PLUGIN)
    entry = next((tmp_path / "cache" / "tables").glob("*.json"))
    good = entry.read_bytes()
    header, _, payload = good.partition(b"\n")
    entry.write_bytes(header + b"\n" + payload.replace(b'"vllm"', b'"vllx"'))  # valid JSON, stale checksum
    again, problems, _ = read_table(path, Tier.PLUGIN)
    assert problems == [] and again == fresh and again is not None and again.rules[0].methods == ("vllm",)
    assert entry.read_bytes() == good  # rewritten from the real parse
    entry.write_bytes(b"0" * 64 + b"\n" + payload)  # a wrong header
    assert read_table(path, Tier.PLUGIN)[0] == fresh
    other = entry.with_name("0" * 64 + ".json")  # a valid entry moved onto another text's name
    other.write_bytes(good)
    assert tablecache.read_entry(other) is None and tablecache.read_entry(entry) is not None


def test_bypass_never_reads_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from quantreg.table import cache as tablecache

    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path / "cache"))
    path = tmp_path / "plugin.yaml"
    path.write_text("version: 1\nrules:\n  - match: {device: cpu}\n    method: vllm\n")
    read_table(path, Tier.PLUGIN)
    entry = next((tmp_path / "cache" / "tables").glob("*.json"))
    forged = tablecache.read_entry(entry)
    entry.write_bytes(tablecache.encode_entry(entry.name, json.loads(json.dumps(forged).replace('"cpu"', '"hpu"'))))
    cached, _, _ = read_table(path, Tier.PLUGIN)
    assert cached is not None and cached.rules[0].match.device == ("hpu",)  # a checksummed entry is believed...
    with tablecache.bypass():
        assert tablecache.bypassed()
        with tablecache.bypass():  # nests
            pass
        assert tablecache.bypassed()
        parsed, _, _ = read_table(path, Tier.PLUGIN)
    assert not tablecache.bypassed()
    assert parsed is not None and parsed.rules[0].match.device == ("cpu",)  # ... except inside bypass()


def test_validate_ignores_a_corrupted_default_table_entry(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert run_cli("validate", env=_cli_env(cache)).returncode == 0  # fills the cache
    entry = _default_entry(cache)
    header, _, payload = entry.read_bytes().partition(b"\n")
    entry.write_bytes(header + b"\n" + json.dumps(_rename_vllm(json.loads(payload))).encode())
    out = run_cli("validate", "--json", env=_cli_env(cache))
    assert out.returncode == 0, out.stdout
    assert json.loads(out.stdout)["problems"] == []


def test_validate_parses_the_files_even_with_a_forged_entry(tmp_path: Path) -> None:
    from quantreg.table import cache as tablecache

    cache = tmp_path / "cache"
    assert run_cli("validate", env=_cli_env(cache)).returncode == 0
    entry = _default_entry(cache)
    data = tablecache.read_entry(entry)
    entry.write_bytes(tablecache.encode_entry(entry.name, _rename_vllm(data)))  # checksum recomputed
    out = run_cli("validate", "--json", env=_cli_env(cache))
    assert out.returncode == 0 and json.loads(out.stdout)["problems"] == [], out.stdout
