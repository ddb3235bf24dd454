"""Finding plugins' entry points (``quantreg.plugins.group_entry_points``): one entry point name in two
distributions is a fault naming both (issue 12 class 5, from test_containment_plugins.py; issue 24
class 5), the same distribution seen twice is not; the answer is importlib's for every installed
distribution and group, keeps importlib's shadowing rule, and never blocks on a FIFO.

Distributions are real: written by :class:`core_support.PluginSite` or as ``dist-info`` directories.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
from importlib import metadata
from pathlib import Path

import pytest
from core_support import GOOD_METHODS, PluginSite, faults, run_quantreg

from quantreg import Registry
from quantreg.plugins import group_entry_points

pytestmark = pytest.mark.usefixtures("clean_env")


# -- from test_containment_plugins.py (issue 12, plugin and start-up classes) -----------------


def test_two_distributions_with_one_entry_point_name(plugin_site: PluginSite) -> None:
    plugin_site.add("qrt-first", {"shared": "qrt_first"}, modules={"qrt_first": GOOD_METHODS})
    plugin_site.add("qrt-second", {"shared": "qrt_second"}, modules={"qrt_second": GOOD_METHODS.replace(
        "good_one", "second_one")})
    registry = Registry.build(env={"QUANTREG_PLUGINS": "shared"})
    [fault] = faults(registry)
    assert fault.startswith("plugin 'shared': entry point name 'shared' is provided by two distributions: ")
    assert "'qrt-first' (qrt_first)" in fault and "'qrt-second' (qrt_second)" in fault
    assert ("good_one" in registry.methods) != ("second_one" in registry.methods)  # exactly one is loaded
    out = run_quantreg("plugins", "--json", site=plugin_site, plugins="shared")
    assert json.loads(out.stdout)["faults"] == [fault]


def test_the_same_distribution_seen_twice_is_not_a_fault(plugin_site: PluginSite, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    plugin_site.add("qrt-twice", {"twice": "qrt_twice"}, modules={"qrt_twice": GOOD_METHODS})
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "qrt_twice-0.1.dist-info").symlink_to(plugin_site.root / "qrt_twice-0.1.dist-info")
    monkeypatch.syspath_prepend(str(copy))
    importlib.invalidate_caches()
    registry = Registry.build(env={"QUANTREG_PLUGINS": "twice"})
    assert faults(registry) == [] and "good_one" in registry.methods


def _eps(eps: list[metadata.EntryPoint] | metadata.EntryPoints) -> list[tuple[str, str, str, str]]:
    return [(ep.name, ep.value, ep.group, ep.dist.metadata["Name"] if ep.dist else "?") for ep in eps]


@pytest.mark.parametrize("group", ["quantreg", "vllm.general_plugins", "console_scripts", "pytest11", "no.such.group"])
def test_group_entry_points_is_importlibs_answer_for_every_installed_distribution(group: str) -> None:
    """The start-up scan (issue 24's budget) skips parsing files that cannot hold the group: the
    answer must be exactly ``metadata.entry_points(group=...)``'s, in its order, on the real venv."""
    ours, theirs = _eps(group_entry_points(group)), _eps(metadata.entry_points(group=group))
    assert ours == theirs
    if group == "console_scripts":
        assert {"pip", "pytest", "quantreg"} <= {name for name, *_ in ours}  # not vacuous, in any venv


def _dist(site: Path, name: str, entry_points: str | None) -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    if entry_points is not None:
        (info / "entry_points.txt").write_text(entry_points)


def test_group_entry_points_keeps_importlibs_shadowing_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution earlier on sys.path shadows one of the same name later, with or without the group."""
    first, second = tmp_path / "first", tmp_path / "second"
    _dist(first, "qr_shadow_a", "[quantreg]\na = mod_a:plugin\n")
    _dist(second, "qr_shadow_a", "[quantreg]\nb = mod_b:plugin\n")
    _dist(first, "qr_shadow_b", "[console_scripts]\nx = m:f\n")  # no [quantreg] in the first copy
    _dist(second, "qr_shadow_b", "[quantreg]\nc = mod_c:plugin\n")
    _dist(second, "qr_mentions", "# [quantreg] in a comment only\n[other]\nd = m:f\n")
    monkeypatch.syspath_prepend(str(second))
    monkeypatch.syspath_prepend(str(first))
    ours = _eps(group_entry_points("quantreg"))
    assert ours == _eps(metadata.entry_points(group="quantreg"))
    names = [name for name, _, _, dist in ours if dist.startswith("qr_")]
    assert names == ["a"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_group_entry_points_never_blocks_on_a_fifo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _dist(tmp_path, "qr_fifo", None)
    os.mkfifo(tmp_path / "qr_fifo-1.0.dist-info" / "entry_points.txt")  # no writer: an open would block
    monkeypatch.syspath_prepend(str(tmp_path))
    result: list[list[metadata.EntryPoint]] = []
    worker = threading.Thread(target=lambda: result.append(group_entry_points("quantreg")), daemon=True)
    worker.start()
    worker.join(10)
    assert result and all(ep.dist is None or ep.dist.metadata["Name"] != "qr_fifo" for ep in result[0])
