"""``quantreg new-plugin NAME [DIR]``: a ready-to-install method plugin distribution, NAME everywhere.

Why: starting a plugin used to mean copying docs/examples/quantreg-example-plugin and renaming it
in five places (distribution, package, entry point, method, class), where one missed rename gives
a plugin that installs but registers nothing, or the example's name twice. The template
(``quantreg/plugin_template/``, the example with its names as placeholders) is written with every
name derived from NAME, so the result installs, is listed, validates and passes the conformance
suite unchanged; the author then replaces the math.

Refusals are one line and exit 1, before anything is written: a NAME that is not a lower-case
identifier (it becomes a Python package and a method name), the built-in method name, and a DIR
that exists and is not empty (never write over someone's files).
"""

from __future__ import annotations

import functools
import json
import keyword
import re
import sys
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from .envelope import envelope
from .files import WriteRefused
from .problems import printable, problem_json
from .writing import dir_target_problem, make_directory, replace_directory, write_new

NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
TEMPLATE = "plugin_template"
SUFFIX = ".tmpl"
RESERVED = frozenset({"vllm"})  # the built-in method: a plugin may not register it


def names(name: str) -> dict[str, str]:
    """Every name of the plugin, from NAME (``demo_x``): the placeholders of the template."""
    return {
        "__NAME__": name,  # method and entry-point name
        "__PACKAGE__": f"quantreg_{name}",
        "__DIST__": f"quantreg-{name.replace('_', '-')}",
        "__CLASS__": "".join(part.capitalize() for part in name.split("_") if part) + "MoEMethod",
        "__ENV__": f"QUANTREG_{name.upper()}_DISABLE",
    }


def name_problem(name: str) -> str | None:
    """Why NAME cannot be a plugin name, or None."""
    if not NAME.fullmatch(name) or name.endswith("_") or "__" in name:
        return (f"invalid plugin name '{name}': expected a lower-case identifier (a letter, then letters, "
                "digits or single underscores, at most 40 characters), e.g. my_mxfp4")
    if keyword.iskeyword(name) or name in RESERVED:
        return f"invalid plugin name '{name}': '{name}' is reserved"
    return None


def _files(root: Traversable, prefix: str = "") -> list[tuple[str, Traversable]]:
    out: list[tuple[str, Traversable]] = []
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.is_dir():
            out += _files(entry, f"{prefix}{entry.name}/")
        elif entry.name.endswith(SUFFIX):
            out.append((prefix + entry.name[: -len(SUFFIX)], entry))
    return out


def render(name: str) -> dict[str, str]:
    """Relative path -> text of every file of the plugin ``name`` (no file system writes)."""
    subs = names(name)
    rendered: dict[str, str] = {}
    for relative, entry in _files(resources.files("quantreg").joinpath(TEMPLATE)):
        text = entry.read_text(encoding="utf-8")
        for placeholder, value in subs.items():
            text = text.replace(placeholder, value)
        if relative.startswith("package/"):  # the template's package directory is named for NAME
            relative = subs["__PACKAGE__"] + relative[len("package"):]
        rendered[relative] = text
    return rendered


def _fill(files: dict[str, str], root: Path) -> None:
    """Write the rendered files into ``root`` (a fresh directory: each file is new)."""
    for relative, text in files.items():
        path = root / relative
        make_directory(path.parent)
        write_new(path, text)


def new_plugin_command(name: str, directory: str | None, *, as_json: bool = False) -> int:
    """Write the plugin; one ``quantreg new-plugin: ...`` line and exit 1 when it cannot."""
    problem = name_problem(name)
    target = Path(names(name)["__DIST__"]) if directory is None and not problem else Path(directory or "")
    shown = printable(str(target) if directory is None else directory) or "''"
    if problem is None:  # the one writer's check: new or empty directory, never a device, FIFO or symlink
        refused = dir_target_problem(str(target) if directory is None else directory, has_force=False)
        problem = None if refused is None else f"{shown}: {refused}"
    files = render(name) if problem is None else {}
    if problem is None:
        try:
            replace_directory(target, functools.partial(_fill, files), has_force=False)
        except WriteRefused as exc:  # /proc/x, /sys/x, a dangling symlink, a read-only parent...
            problem = f"{shown}: {exc}"
    if problem:
        if as_json:  # --json answers in JSON on failure too (the envelope; the problem names the directory)
            where = None if name_problem(name) else str(target)
            print(json.dumps({"ok": False, **envelope([problem_json(problem, path=where)])}, indent=2))
        print(f"quantreg new-plugin: {problem}", file=sys.stderr)
        return 1
    subs = names(name)
    if as_json:
        print(json.dumps({"directory": str(target.resolve()), "distribution": subs["__DIST__"],
                          "package": subs["__PACKAGE__"], "method": name, "class": subs["__CLASS__"],
                          "files": sorted(files), **envelope([])}, indent=2))
    else:
        print(f"wrote plugin {subs['__DIST__']} (method {name}, class {subs['__PACKAGE__']}.method:"
              f"{subs['__CLASS__']}) to {shown}\nnext:\n  pip install -e '{shown}[test]'\n  quantreg list\n"
              f"  quantreg validate {target / subs['__PACKAGE__'] / 'rules.yaml'}\n  quantreg check-method {name}")
    return 0
