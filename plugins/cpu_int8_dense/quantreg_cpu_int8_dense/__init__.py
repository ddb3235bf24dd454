"""quantreg plugin: int8 weights for vLLM's dense layers on CPU (see README.md)."""
