"""The bench scripts' command-line checks: a bad value is one line naming the argument, exit status 2.

Why one home: argparse's ``type=int`` accepts ``-1`` and ``0`` where a count must be positive (the
run then fails minutes later with a traceback, or never ends), quotes a 5,000-digit value whole,
and prints a usage block before its error; a comma-separated list parsed with ``int()`` inside
``run()`` raised ``ValueError`` tracebacks for ``--clients 1,four`` or ``1,,0``. Every numeric
argument of every bench script goes through :func:`whole` or :func:`whole_list` with its bounds,
and files a run reads from a checkpoint (``config.json``) through :func:`model_config`, so a bench
invoked wrong says what and where in one line (issue 53, class 6).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn

_DIGITS = 12
"""A number with more digits than this is refused by its length, never converted (Python's
``int()`` refuses 4,300+ digits with a message about its own limit)."""
_CONFIG_BYTES = 1 << 20


class Parser(argparse.ArgumentParser):
    """argparse with its errors as one line: ``prog: error: argument --x: why`` and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def fail(message: str) -> NoReturn:
    """A bad input found after parsing (a checkpoint's files): the same one line, exit status 2."""
    sys.stderr.write(f"{os.path.basename(sys.argv[0]) or 'bench'}: error: {' '.join(message.split())}\n")
    raise SystemExit(2)


def _number(item: str, low: int, high: int) -> int:
    text = item.strip()
    if not text:
        raise argparse.ArgumentTypeError(f"an empty item; expected whole numbers from {low:,} to {high:,}")
    digits = text.lstrip("+-")
    if digits.isascii() and digits.isdigit() and len(digits) > _DIGITS:
        raise argparse.ArgumentTypeError(f"{text[:12]!r}... is too large ({len(digits):,} digits); "
                                         f"expected a whole number from {low:,} to {high:,}")
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a whole number; expected one from {low:,} to "
                                         f"{high:,}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{value} is out of range; expected a whole number from {low:,} to {high:,}")
    return value


def whole(low: int, high: int) -> Callable[[str], int]:
    """``type=`` for one whole number in ``[low, high]``."""
    def parse(text: str) -> int:
        return _number(text, low, high)
    parse.__name__ = "whole number"
    return parse


def decimal(low: float, high: float) -> Callable[[str], float]:
    """``type=`` for one finite number in ``[low, high]`` (seconds, GiB): never ``nan``, ``inf`` or 5,000 digits."""
    def parse(text: str) -> float:
        item = text.strip()
        if len(item) > 40:
            raise argparse.ArgumentTypeError(f"{item[:12]!r}... is too long ({len(item):,} characters); "
                                             f"expected a number from {low:g} to {high:g}")
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not a number; expected one from {low:g} "
                                             f"to {high:g}") from None
        if not low <= value <= high:  # nan fails both comparisons
            raise argparse.ArgumentTypeError(f"{item} is out of range; expected a number from {low:g} to {high:g}")
        return value
    parse.__name__ = "number"
    return parse


def whole_list(low: int, high: int) -> Callable[[str], list[int]]:
    """``type=`` for comma-separated whole numbers in ``[low, high]``, no empty item, at least one."""
    def parse(text: str) -> list[int]:
        items = text.split(",")
        values = []
        for i, item in enumerate(items):
            try:
                values.append(_number(item, low, high))
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentTypeError(f"item {i + 1} of {text[:40]!r}: {exc}") from None
        return values
    parse.__name__ = "list of whole numbers"
    return parse


def model_config(model: Path, keys: Iterable[str]) -> dict[str, Any]:
    """``--model DIR``'s ``config.json``, each of ``keys`` a positive integer; else :func:`fail`."""
    path = model / "config.json"
    try:
        with path.open("rb") as f:
            data = f.read(_CONFIG_BYTES + 1)
    except OSError as exc:
        fail(f"argument --model: {path}: cannot read it ({exc.strerror or type(exc).__name__}); expected a "
             "checkpoint directory (quantreg tiny-model writes one)")
    if len(data) > _CONFIG_BYTES:
        fail(f"argument --model: {path}: larger than {_CONFIG_BYTES:,} bytes; not a model's config.json")
    try:
        config = json.loads(data)
    except ValueError as exc:
        fail(f"argument --model: {path}: not JSON ({exc}); a truncated or damaged config.json")
    if not isinstance(config, dict):
        fail(f"argument --model: {path}: expected a JSON object, got {type(config).__name__}")
    for key in keys:
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            fail(f"argument --model: {path}: {key}: expected a positive whole number, got {str(value)[:40]!r}")
    return config
