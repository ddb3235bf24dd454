"""The ``quantreg demo`` command and the tiny GPT-OSS MXFP4 checkpoint it (and the e2e tests) run.

Why a separate package: quantreg itself must stay importable without torch or vLLM (it
is loaded by vLLM's plugin hook in every process, and by tooling that has neither).
Only :mod:`quantreg.tiny.checkpoint` imports torch / safetensors (the command runs vLLM through
:mod:`quantreg.testing.vllm_run`, in a child process), so this ``__init__`` deliberately imports
nothing from them.
"""

__all__: list[str] = []
