"""Layer shapes the conformance kit checks a method at, and the run grid each shape gets.

Why: tiny layers are fast and exercise padding, but never reach the code paths real sizes take
(threaded decodes, blocked GEMMs, repacking of wide rows). ``quantreg check-method NAME --shape
20b`` checks one real GPT-OSS-20B layer (E=32, H=I=2880); ``E,H,I`` gives any other. Real shapes
get a smaller grid of forwards (GPT-OSS's top-4, 1 and 16 tokens: decode and a small prefill),
because every forward is compared with a float64 evaluation of the routed experts.

No torch here: the CLI parses ``--shape`` before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..bounds import MAX_SIZE, shown, text_count

BLOCK = 32


@dataclass(frozen=True)
class MoeShape:
    """A GPT-OSS MoE layer's sizes. The defaults are small (fast) yet exercise padding:
    intermediate 96 is not a multiple of 64, which vLLM's MXFP4 methods round up to."""

    num_experts: int = 8
    hidden: int = 64
    intermediate: int = 96

    @property
    def small(self) -> bool:
        """At most the default's size class: the full grid of runs is affordable."""
        return self.num_experts * self.hidden * self.intermediate <= 1 << 20

    def label(self) -> str:
        return f"E={self.num_experts}, H={self.hidden}, I={self.intermediate}"


DEFAULT_SHAPE = MoeShape()
"""The kit's default layer (what ``--shape small`` names)."""

PRESETS: dict[str, MoeShape] = {
    "small": DEFAULT_SHAPE,
    "20b": MoeShape(32, 2880, 2880),
    "120b": MoeShape(128, 2880, 2880),
}
"""Named shapes: the kit's default, and the MoE layers of GPT-OSS-20B and -120B."""


@dataclass(frozen=True)
class Grid:
    """Which forwards the numerical checks run at a shape."""

    tokens: tuple[int, ...]
    top_ks: tuple[int, ...]
    ep_tokens: tuple[int, ...]
    ep_top_ks: tuple[int, ...]


SMALL_GRID = Grid(tokens=(1, 7, 64), top_ks=(1, 2, 3, 4), ep_tokens=(7, 64), ep_top_ks=(1, 4))
REAL_GRID = Grid(tokens=(1, 16), top_ks=(4,), ep_tokens=(16,), ep_top_ks=(4,))


def grid_for(shape: MoeShape) -> Grid:
    return SMALL_GRID if shape.small else REAL_GRID


def parse_shape(text: str) -> MoeShape:
    """``small``/``20b``/``120b`` or ``E,H,I`` (experts, hidden, intermediate); ValueError saying what is expected."""
    name = text.strip().lower()
    if name in PRESETS:
        return PRESETS[name]
    parts = [p.strip() for p in name.split(",")]
    expected = (f"expected one of {', '.join(PRESETS)} or E,H,I (experts, hidden, intermediate; "
                f"H and I multiples of {BLOCK}, E >= 2, each at most {MAX_SIZE:,}), got {shown(text)}")
    # bounded before int() reads a digit (5,000 of them) and before any layer is built (10^12 experts)
    numbers = [text_count(p, 1, MAX_SIZE) for p in parts]
    if len(parts) != 3 or None in numbers:
        raise ValueError(expected)
    experts, hidden, inter = (int(n) for n in numbers if n is not None)
    if experts < 2 or hidden < BLOCK or inter < BLOCK or hidden % BLOCK or inter % BLOCK:
        raise ValueError(expected)
    return MoeShape(experts, hidden, inter)
