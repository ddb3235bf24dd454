"""What quantreg knows about the models it serves, one module per model family.

:mod:`quantreg.models.gpt_oss` holds GPT-OSS's constants and its ``config.json`` without torch
(so the plugin's option defaults and tiny test models can read them anywhere);
:mod:`quantreg.models.gpt_oss_moe` is the float64 MoE reference built on them and imports torch.
This package itself imports nothing.
"""
