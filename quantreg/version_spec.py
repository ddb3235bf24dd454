"""Release numbers and version specifiers (``">=0.30,<0.40"``): the one parser.

Why one: ``Method.vllm_version`` and the tested vLLM range (:mod:`quantreg.vllm.versions`) had a
parser each. Pure Python, no ``packaging``: ``register()`` runs in every vLLM process and must
not pay for it. Only ``>=, >, <=, <, ==, !=`` clauses of numeric releases; pre-releases, dev
builds and local labels are ignored on purpose (a ``0.33.0.dev`` build already carries 0.33's API,
so it counts as 0.33.0, not as "before 0.33" as PEP 440 ordering would have it).
"""

from __future__ import annotations

import re

_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)\s*$")


def release(version: str) -> tuple[int, ...] | None:
    """The numeric release of ``version`` (``"0.28.1.dev12+g14617c2b"`` -> ``(0, 28, 1)``), trailing
    zeros dropped (``0.28 == 0.28.0``); ``None`` when the string has no leading number."""
    match = _RELEASE.match(version)
    if match is None:
        return None
    parts = [int(p) for p in match.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def check_specifier(spec: str) -> str | None:
    """``None`` if ``spec`` is a comma-separated list of simple clauses, else what is wrong."""
    for clause in spec.split(","):
        if not _CLAUSE.match(clause):
            return f"cannot read version clause {clause.strip()!r}; expected e.g. '>=0.30,<0.40'"
    return None


def satisfies(version: str | tuple[int, ...], spec: str) -> bool:
    """Does ``version`` meet every clause of ``spec``? An unreadable version meets none.

    Raises ``ValueError`` for a clause :func:`check_specifier` would reject: specifiers are
    checked where they are declared, so one reaching here is a bug, not input.
    """
    have = release(version) if isinstance(version, str) else version
    if have is None:
        return False
    for clause in spec.split(","):
        match = _CLAUSE.match(clause)
        if match is None:
            raise ValueError(f"unsupported version clause {clause!r} in {spec!r}")
        op, bound = match.group(1), release(match.group(2))
        assert bound is not None
        ok = {">=": have >= bound, ">": have > bound, "<=": have <= bound, "<": have < bound,
              "==": have == bound, "!=": have != bound}[op]
        if not ok:
            return False
    return True
