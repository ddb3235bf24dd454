"""Issue 33.5: what the docs say about host kinds is true, and named by what decides behaviour.

Three kinds of x86 host have run this project: AVX2 only, AVX-512 without AMX, AVX-512 with AMX.
What decides behaviour is AMX (vLLM's own CPU MXFP4 kernel) and AVX-512 (plugin #2's ISA path),
never the vendor, so the docs name kinds by those; and this host's kind (``quantreg.host``'s
facts, what every decision reads) must be one the docs list.
"""

from __future__ import annotations

import re
from pathlib import Path

from quantreg.host import host_facts

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: quantreg.host kinds -> the words the docs use for them
KINDS = {"avx2": "AVX2 only", "avx512": "AVX-512 without AMX", "amx": "AVX-512 with AMX"}


def test_the_docs_list_the_three_kinds_and_this_hosts_kind() -> None:
    for doc in (ROOT / "README.md", ROOT / "docs" / "reliability.md", ROOT / "docs" / "compat.md"):
        text = " ".join(doc.read_text(encoding="utf-8").split())
        for words in KINDS.values():
            assert words.lower() in text.lower(), f"{doc.name} does not name the kind '{words}'"
    kind = host_facts().kind
    if kind in KINDS:  # x86: this very host is one of the documented kinds
        assert KINDS[kind] in " ".join((ROOT / "docs" / "compat.md").read_text().split())


def test_no_doc_ties_a_cpu_kind_to_a_vendor() -> None:
    """'AMD EPYC, AVX2 only' was wrong once the same vendor's AVX-512 hosts arrived: name the ISA instead."""
    vendor_kind = re.compile(r"(AMD EPYC|EPYC|Intel Xeon|Xeon)[^.\n|]{0,30}(AVX2|AVX-512|AMX)", re.I)
    kind_vendor = re.compile(r"(AVX2-only|AVX2 only|AMX)[ ,]+(AMD EPYC|EPYC|Intel Xeon|Xeon)", re.I)
    found = [f"{doc.name}:{n}: {line.strip()[:100]}" for doc in DOCS
             for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
             if (vendor_kind.search(line) or kind_vendor.search(line)) and "vllm-0.33" not in doc.name]
    assert not found, "\n".join(found)


def test_the_probe_reason_names_the_isa_path_as_documented() -> None:
    """The plugin README quotes the probe's reason; the probe (real, installed) says the same."""
    import pytest

    probe = pytest.importorskip("quantreg_cpu_mxfp4.probe")
    ok, why = probe.kernel_available()
    if not ok:
        pytest.skip(why)
    readme = (ROOT / "plugins" / "cpu_mxfp4" / "README.md").read_text(encoding="utf-8")
    assert why.startswith("kernel loaded: libquantreg_cpu_mxfp4.so (ABI 3), ISA path ")
    assert "kernel loaded: libquantreg_cpu_mxfp4.so (ABI 3), ISA path avx512\n(AVX-512 VNNI)" in readme
    assert why.split("ISA path ")[1] in ("avx512 (AVX-512 VNNI)", "avx2 (AVX2+FMA)",
                                         f"avx2 (AVX2+FMA, forced by {probe.ISA_ENV})")
