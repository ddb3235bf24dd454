"""vLLM integration (placeholder until the seam lands)."""


def register() -> None:
    """vLLM general-plugin entry point."""
