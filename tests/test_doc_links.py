"""Every relative link in README.md and docs/*.md resolves: the README was split into docs/ pages
(issue 22.10), and a moved section must not leave a newcomer at a dead link.

A link is ``[text](target)``; ``http(s):``/``mailto:`` targets are not checked (no network here).
A ``#fragment`` must name a heading of the target file (GitHub's slugs: lower case, punctuation
dropped, spaces to hyphens).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def slug(heading: str) -> str:
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text(encoding="utf-8")))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file {resolved}")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}: no heading '#{fragment}' in {resolved.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_checker_sees_links_and_headings() -> None:
    """The check must not pass by finding nothing."""
    readme = links(ROOT / "README.md")
    assert "docs/operating.md" in readme and "docs/tables.md" in readme
    assert {"quick-start", "the-table-in-brief"} <= anchors(ROOT / "README.md")
    assert slug("Strict and lenient start-up") == "strict-and-lenient-start-up"
    assert slug("`quantreg check-method`") == "quantreg-check-method"


#: Sentences that describe the one machine a page was written on as if it were the reader's: true on
#: one kind of CI host, false on the other (issue 22 class 9). Measurements say where they were taken.
ONE_MACHINE = ("this machine", "this cpu has", "this cpu machine", "this avx2 cpu", "2 amd epyc cores here")


def test_no_page_describes_the_writers_machine_as_the_readers() -> None:
    pages = [*PAGES, *sorted((ROOT / "plugins").glob("*/README.md"))]
    found = [f"{page.relative_to(ROOT)}:{n}: {line.strip()}"
             for page in pages for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
             if any(phrase in line.lower() for phrase in ONE_MACHINE)]
    assert not found, "host-specific wording (say which host kind, or 'measured on ...'):\n" + "\n".join(found)
