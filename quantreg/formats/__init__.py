"""Weight formats shared by method plugins and the conformance kit.

Each format lives in its own submodule (``quantreg.formats.mxfp4``) and may import torch;
this package itself imports nothing, so ``import quantreg`` stays free of torch and vLLM.
"""
