"""quantreg.installed: distribution names and versions read as the start-up hook reads them.

``dist_name_version`` replaced ``Distribution.name`` / ``.version`` (an ``email`` parse of the
whole METADATA per access) on ``register()``'s path (issue 24's start-up budget): it must give the
same answers for every real distribution, and never block on a planted file.
"""

from __future__ import annotations

import os
import threading
from importlib import metadata
from pathlib import Path

import pytest

from quantreg.installed import build_failure, dist_name_version, dist_version


def test_every_installed_distribution_reads_as_importlib_reads_it() -> None:
    dists = list(metadata.distributions())
    assert len(dists) >= 5  # pluggy, PyYAML, pytest, ... and quantreg itself: not vacuous
    for dist in dists:
        assert dist_name_version(dist) == (dist.metadata["Name"], dist.version), getattr(dist, "_path", dist)
    assert dist_version("quantreg") == metadata.version("quantreg")
    assert dist_version("no-such-distribution-quantreg-test") is None


def write_dist(site: Path, dirname: str, filename: str, text: str) -> metadata.Distribution:
    info = site / dirname
    info.mkdir(parents=True)
    (info / filename).write_text(text)
    return metadata.PathDistribution(info)


def test_header_block_only_and_egg_info(tmp_path: Path) -> None:
    dist = write_dist(tmp_path, "demo-1.2.dist-info", "METADATA",
                      "Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.2\n\nName: not-a-header\nVersion: 9\n")
    assert dist_name_version(dist) == ("demo-pkg", "1.2")
    egg = write_dist(tmp_path, "old.egg-info", "PKG-INFO", "Metadata-Version: 1.0\nName: old\nVersion: 0.1\n")
    assert dist_name_version(egg) == ("old", "0.1")
    lower = write_dist(tmp_path, "lower-3.dist-info", "METADATA", "metadata-version: 2.1\nname: lower\nVERSION: 3\n")
    assert dist_name_version(lower) == ("lower", "3") == (lower.metadata["Name"], lower.version)
    missing = write_dist(tmp_path, "nameless-1.dist-info", "METADATA", "Metadata-Version: 2.1\nVersion: 1\n")
    assert dist_name_version(missing) == (None, "1")  # the callers show '?'
    empty = tmp_path / "empty-1.dist-info"
    empty.mkdir()
    assert dist_name_version(metadata.PathDistribution(empty)) == (None, None)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_metadata_never_blocks(tmp_path: Path) -> None:
    info = tmp_path / "trap-1.dist-info"
    info.mkdir()
    os.mkfifo(info / "METADATA")  # no writer: opening it for reading would block forever
    result: list[tuple[str | None, str | None]] = []
    worker = threading.Thread(target=lambda: result.append(dist_name_version(metadata.PathDistribution(info))),
                              daemon=True)
    worker.start()
    worker.join(10)
    assert result == [(None, None)]


def test_build_failure_reads_the_plugins_record_or_says_none(tmp_path: Path) -> None:
    """A native plugin's setup.py record (one line, whitespace around it dropped); none, or an
    unreadable one (a directory in its place), is ``None``, never an exception."""
    record = tmp_path / "BUILD_FAILED.txt"
    assert build_failure(record) is None
    record.write_text("quantreg-x: compiled kernel NOT built (g++ exited 1)\n", encoding="utf-8")
    assert build_failure(record) == "quantreg-x: compiled kernel NOT built (g++ exited 1)"
    record.unlink()
    record.mkdir()
    assert build_failure(record) is None
