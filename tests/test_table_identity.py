"""quantreg.table.identity: a packaged table's name in the fingerprint, under every kind of install.

Issue 31.4: under ``pip install -e`` with setuptools (plugin #2 and #3), the editable finder maps
the package to its source directory and puts no directory on ``sys.path``; the repository root
is on it (hatchling's ``.pth`` for quantreg itself). The name was then looked up for ``plugins``,
a full metadata scan ran in every vLLM process, and the table was named by its layer, not as under
a wheel. Here a real finder of that kind and a real ``.dist-info`` stand in for the install.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator, Sequence
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest

from quantreg.table import identity


class MappedFinder(importlib.abc.MetaPathFinder):
    """What setuptools' editable finder does: one top-level name mapped to one source directory."""

    def __init__(self, name: str, directory: Path) -> None:
        self.name, self.directory = name, directory

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        return importlib.util.spec_from_file_location(fullname, self.directory / "__init__.py",
                                                      submodule_search_locations=[str(self.directory)])


def _clear() -> None:
    identity._metadata_dirs.cache_clear()
    identity._owners.cache_clear()
    identity._package_name.cache_clear()
    identity._scanned_owners.cache_clear()


@pytest.fixture
def editable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    repo = tmp_path / "repo"
    package = repo / "plugins" / "mapped" / "qrt_mapped_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "rules.yaml").write_text("version: 1\nrules: []\n")
    info = tmp_path / "site" / "qrt_mapped_pkg-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: qrt-mapped-pkg\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("qrt_mapped_pkg\n")
    (info / "RECORD").write_text("__editable__.qrt_mapped_pkg-1.0.pth,,\nqrt_mapped_pkg-1.0.dist-info/METADATA,,\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.syspath_prepend(str(repo))  # the repository root, as quantreg's own editable .pth puts it
    monkeypatch.setattr(sys, "meta_path", [MappedFinder("qrt_mapped_pkg", package), *sys.meta_path])
    _clear()
    yield package / "rules.yaml"
    sys.modules.pop("qrt_mapped_pkg", None)
    _clear()


def test_a_table_of_a_mapped_editable_package_is_named_by_its_distribution(editable: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    scans: list[int] = []
    full = metadata.packages_distributions
    monkeypatch.setattr(metadata, "packages_distributions", lambda: scans.append(1) or full())
    assert identity.package_name(str(editable)) == "qrt-mapped-pkg:qrt_mapped_pkg/rules.yaml"
    assert scans == []  # no full metadata scan
    assert "qrt_mapped_pkg" not in sys.modules  # asked of the finder, not imported


def test_the_same_name_once_the_package_is_imported(editable: Path) -> None:
    import qrt_mapped_pkg  # type: ignore[import-not-found]  # the plugin is loaded when its hook gives the table

    assert Path(qrt_mapped_pkg.__file__).parent == editable.parent
    assert identity.package_name(str(editable)) == "qrt-mapped-pkg:qrt_mapped_pkg/rules.yaml"


def test_a_table_outside_any_package_has_no_package_name(tmp_path: Path) -> None:
    _clear()
    loose = tmp_path / "not a package" / "t.yaml"
    loose.parent.mkdir()
    loose.write_text("version: 1\nrules: []\n")
    assert identity.package_name(str(loose)) is None
