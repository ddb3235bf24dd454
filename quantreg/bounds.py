"""The one bound on every number a user writes: table fields, CLI arguments, config.json sizes.

Why one module: each reader had its own idea of a number. A ``tokens:`` bound of 4,300 digits
passed ``validate`` and made ``explain`` fail; one of 5,000 digits surfaced Python's
``sys.set_int_max_str_digits`` text; ``tiny-model --layers 1000000`` allocated until memory ran
out; a config.json that lies about its sizes made ``tune`` allocate before it refused. Every such
number is now checked here *before any work*, and a refusal names the value (never all of its
digits) and the range that was expected; the caller adds where it was written (FILE:LINE: key,
``--layers``, ``config.json: num_local_experts``).
"""

from __future__ import annotations

import math
from typing import Any

from .problems import printable, type_name

MAX_COUNT = 2**31 - 1
"""Largest count a user may write: token counts (``tokens:``, ``tuned`` token keys), ``verify:``
counts, layer indices. vLLM's own counters are 32-bit (``max_num_batched_tokens``), so no larger
count can ever be met."""
MAX_PRIORITY = 10**9
"""Largest ``priority:`` magnitude (any ordering of rules fits far inside it)."""
MAX_SIZE = 1 << 20
"""Largest model size field read from config.json or a CLI (hidden, intermediate, experts, vocab,
heads, head_dim): over 4x GPT-OSS-120B's vocabulary and 300x its hidden size."""
MAX_LAYERS = 1024
"""Largest layer count or index read from a table (``verify: layers``) or a config.json (``num_hidden_layers``)."""
MAX_TINY_LAYERS = 256
"""Largest ``tiny-model --layers``: a checkpoint a tool writes (GPT-OSS-120B has 36 layers; 256 tiny layers are
~500 MB, built in memory; at 20B width each layer is ~0.55 GB on disk)."""
MAX_BUDGET_S = 1e6
"""Largest ``tune --budget`` in seconds (11.6 days); a budget is also recorded as ``tuned.budget_s``."""
MAX_DIGITS = 12
"""A number written as text with more digits than this is refused before ``int()`` reads it."""


def shown(value: Any) -> str:
    """``value`` for a message: its type in YAML's words (:func:`quantreg.problems.type_name`) and a short form;
    a huge integer by its digit count only.

    Python refuses to print integers of more than 4,300 digits (``sys.set_int_max_str_digits``),
    and a message quoting 4,000 digits is no message: an integer past :data:`MAX_DIGITS` digits is
    ``an integer of N digits`` (counted from its bit length, never converted to text).
    """
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int):
        digits = int(abs(value).bit_length() * math.log10(2)) + 1 if value else 1
        if digits > MAX_DIGITS:
            return f"an integer of about {digits:,} digits"
        return f"integer {value}"
    if isinstance(value, float):
        return f"number {value!r}"
    if isinstance(value, str):
        text = value if len(value) <= 40 else value[:37] + "..."
        return f"string {printable(repr(text))}"
    return type_name(value)


def whole_problem(value: Any, low: int = 1, high: int = MAX_COUNT, what: str = "a whole number") -> str | None:
    """Why ``value`` is not an integer (bool excluded) from ``low`` to ``high``; ``None`` when it is."""
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
        return None
    return f"expected {what} from {low:,} to {high:,}, got {shown(value)}"


def text_count(text: str, low: int = 1, high: int = MAX_COUNT) -> int | None:
    """The whole number ``text`` spells in ASCII digits when it is from ``low`` to ``high``, else ``None``.

    At most :data:`MAX_DIGITS` digits are ever converted (``"²"`` passes ``str.isdigit``, not ``int``).
    """
    if not text or len(text.lstrip("0")) > MAX_DIGITS or not (text.isascii() and text.isdigit()):
        return None
    number = int(text)
    return number if low <= number <= high else None


def number_problem(value: Any, low: float = 0.0, high: float = float(MAX_COUNT), what: str = "a number",
                   low_open: bool = False) -> str | None:
    """Why ``value`` is not a finite int or float from ``low`` (exclusive when ``low_open``) to ``high``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if math.isfinite(number) and (number > low if low_open else number >= low) and number <= high:
            return None
    bound = f"above {low:g}" if low_open else f"from {low:g}"
    return f"expected {what} {bound} to {high:g}, got {shown(value)}"
