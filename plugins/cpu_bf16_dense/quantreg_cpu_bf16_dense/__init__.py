"""quantreg plugin: vLLM's dense layers in bf16 on CPU with this distribution's own kernel (see README.md)."""
