"""Run llama.cpp's own converter (``convert_hf_to_gguf.py``) on a quantreg-written GPT-OSS checkpoint.

Usage (with the llama environment's Python, see ``bench/llama_setup.sh``):
``python bench/gguf_convert.py CONVERTER MODEL_DIR --outtype q8_0|bf16 --outfile OUT.gguf``

Why a wrapper: the converter names a byte-level BPE tokenizer's pre-tokenizer by hashing the ids it
gives a fixed text, and knows only published vocabularies; the synthetic checkpoint's tokenizer
(:mod:`quantreg.tiny.tokenizer`) is GPT-2's byte-level pre-tokenizer (``ByteLevel``, GPT-2's regex)
over a vocabulary of its own, so no hash can match and the converter stops with "BPE pre-tokenizer
was not recognized". This wrapper says ``gpt-2`` for exactly that case (the hash lookup still runs
first, and a tokenizer other than quantreg's is refused), then runs the converter unchanged as
``__main__``: tensors, MXFP4 expert repacking and the dense ``--outtype`` are all llama.cpp's code.
Standard library only besides what the converter itself imports; never imports quantreg.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

#: tokenizer.json's pre-tokenizer as quantreg writes it: GPT-2's byte-level split.
_QUANTREG_PRE = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def main() -> None:
    converter = Path(sys.argv[1]).resolve()
    args = sys.argv[2:]
    sys.path.insert(0, str(converter.parent))
    sys.path.insert(1, str(converter.parent / "gguf-py"))
    from conversion import base  # type: ignore[import-not-found]

    original = base.TextModel.get_vocab_base_pre

    def vocab_base_pre(self: object, tokenizer: object) -> str:
        try:
            return str(original(self, tokenizer))
        except NotImplementedError:
            import json

            spec = json.loads((Path(self.dir_model) / "tokenizer.json").read_text())  # type: ignore[attr-defined]
            if spec.get("pre_tokenizer") != _QUANTREG_PRE:
                raise
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = vocab_base_pre
    sys.argv = [str(converter), *args]
    runpy.run_path(str(converter), run_name="__main__")


if __name__ == "__main__":
    main()
