"""Demo and end-to-end harness: a tiny GPT-OSS MXFP4 checkpoint and a real-vLLM runner.

Why a separate package: quantreg itself must stay importable without torch or vLLM (it
is loaded by vLLM's plugin hook in every process, and by tooling that has neither).
Only :mod:`quantreg.demo.checkpoint` and :mod:`quantreg.demo.runner` import torch /
safetensors / vLLM, so this ``__init__`` deliberately imports nothing from them.
"""

__all__: list[str] = []
