"""Every hook is documented with its exact signature and exercised by a test (datasette's rule).

Adding a hookspec without a docs section in docs/plugins.md, or without a test that implements
it, fails here, so the plugin API cannot drift away from its documentation.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from quantreg import hookspecs

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
HOOKS = [
    name
    for name, fn in vars(hookspecs).items()
    if inspect.isfunction(fn) and hasattr(fn, "quantreg_spec")
]


def signature_text(name: str) -> str:
    fn = getattr(hookspecs, name)
    sig = inspect.signature(fn)
    params = ", ".join(f"{p.name}: {p.annotation}" for p in sig.parameters.values())
    return f"def {name}({params}) -> {sig.return_annotation}"


def test_there_are_hooks() -> None:
    assert set(HOOKS) == {"register_methods", "register_tables", "register_quant_config_keepers",
                          "doctor_findings", "register_vllm_limitations"}


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_with_exact_signature(hook: str) -> None:
    assert re.search(rf"^## {hook}$", DOCS, re.M), f"docs/plugins.md has no '## {hook}' section"
    section = DOCS.split(f"## {hook}\n", 1)[1].split("\n## ", 1)[0]
    assert signature_text(hook) in section, f"docs/plugins.md '{hook}' lacks the signature {signature_text(hook)!r}"
    assert getattr(hookspecs, hook).__doc__, f"hookspec {hook} has no docstring"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_exercised_by_a_test(hook: str) -> None:
    pattern = re.compile(rf"@(?:quantreg\.)?hookimpl\s*\n\s*def {hook}\(")
    users = [
        p.relative_to(ROOT)
        for p in [*ROOT.glob("tests/**/*.py"), *ROOT.glob("plugins/*/tests/**/*.py")]
        if p.name != Path(__file__).name and pattern.search(p.read_text(encoding="utf-8"))
    ]
    assert users, f"no test implements the hook '{hook}'"
