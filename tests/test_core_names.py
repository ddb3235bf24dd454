"""Core names no plugin (issue 24.1): the methods, option names and environment flags that the
installed plugin distributions register or read appear nowhere in ``quantreg/``.

Read from the plugins themselves, not a hand list: the methods and options from their real
``register_methods`` registrations (installed entry points), the flags from the string constants
of their distributions' files that look like environment variable names. A second plugin that
core would have to learn about by name fails this test the day it is installed.
"""

from __future__ import annotations

import ast
import re
from importlib import metadata
from pathlib import Path

import pytest

from quantreg import builtin
from quantreg.registry import Registry

PACKAGE = Path(__file__).resolve().parents[1] / "quantreg"
ENV_NAME = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+$")
#: Core files allowed to name a plugin's words, each with its reason (docs/design.md says the same).
ALLOWED = {
    "demo/command.py": "`quantreg demo` is plugin #1's demo by design: its table routes to plugin #1's methods",
    "vllm_limits.py": "its note suggests a method by name; the module is being rewritten on another branch "
                      "(the lead moves it to quantreg/vllm/ and drops the example)",
}


def _plugin_distributions() -> list[metadata.Distribution]:
    dists = {}
    for ep in metadata.entry_points(group="quantreg"):
        if ep.dist is not None and ep.dist.metadata["Name"] != "quantreg":
            dists[ep.dist.metadata["Name"]] = ep.dist
    return list(dists.values())


def _env_flags(dist: metadata.Distribution) -> set[str]:
    flags: set[str] = set()
    for file in dist.files or ():
        if not str(file).endswith(".py") or ".dist-info" in str(file):
            continue
        path = Path(str(file.locate()))
        if not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.match(node.value):
                flags.add(node.value)
    return flags


def plugin_words() -> tuple[set[str], set[str]]:
    """(method names and env-like flags, option names) of every installed plugin."""
    registry = Registry.build()
    names: set[str] = set()
    options: set[str] = set()
    for m in registry.methods.values():
        if m.plugin and m.plugin != builtin.NAME and not m.plugin.startswith("table "):
            names.add(m.name)
            options.update(m.options or ())
    for dist in _plugin_distributions():
        names |= _env_flags(dist)
    return names, options


def model_parameters() -> set[str]:
    """Parameter names of core's float64 model reference (read from its source, no torch import).

    A plugin option that is one of them (GPT-OSS's ``alpha``, ``limit``) is the model's word, which
    core knows as model knowledge, not a name core learnt from the plugin."""
    tree = ast.parse((PACKAGE / "models" / "gpt_oss_moe.py").read_text(encoding="utf-8"))
    return {a.arg for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
            for a in (*node.args.args, *node.args.kwonlyargs)}


def _alternatives(words: set[str]) -> str:
    return "|".join(sorted(map(re.escape, words), key=len, reverse=True))


def test_core_names_no_installed_plugins_methods_options_or_flags() -> None:
    names, options = plugin_words()
    if not names:
        pytest.skip("no quantreg plugin distribution is installed here (plugins/hpu_mxfp4 is one)")
    assert len(names) > 2 and options  # the plugins' words were really read
    options -= model_parameters()
    # Method names and flags anywhere (code, docstrings, YAML); option names are often plain words
    # (alpha, limit), so they count where core would use them as names: quoted, or as a YAML key.
    pattern = re.compile(rf"(?<![A-Za-z0-9_])({_alternatives(names)})(?![A-Za-z0-9_])"
                         rf"|[\"']({_alternatives(options)})[\"']")
    yaml_key = re.compile(rf"^\s*({_alternatives(options)}):")
    found = []
    for path in sorted(PACKAGE.rglob("*")):
        rel = str(path.relative_to(PACKAGE))
        if not path.is_file() or path.suffix not in (".py", ".yaml") or rel in ALLOWED:
            continue
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            matches = [*pattern.finditer(line), *(yaml_key.finditer(line) if path.suffix == ".yaml" else ())]
            found += [f"quantreg/{rel}:{lineno}: {m.group(0).strip()}" for m in matches]
    assert found == []
