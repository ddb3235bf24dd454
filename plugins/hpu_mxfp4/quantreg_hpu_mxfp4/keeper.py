"""The quant-config keeper for vllm-gaudi's GPT-OSS MXFP4 switch, as a value (strings only).

Why its own module: :mod:`.plugin` registers it in every vLLM process (importing nothing heavy) and
:mod:`.vllm_gaudi` acts on it; with the value in either of the two, each imported the other.
"""

from __future__ import annotations

from quantreg import QuantConfigKeeper

VLLM_GAUDI_MODULE = "vllm_gaudi.models.gptoss_mxfp4"
KEEPER = QuantConfigKeeper(
    name="vllm_gaudi_gpt_oss_mxfp4",
    quant_method="mxfp4",
    quant_format="gpt_oss_mxfp4",
    model_type="gpt_oss",
    module=VLLM_GAUDI_MODULE,
    target="quantreg_hpu_mxfp4.vllm_gaudi:keep_native",
    description="vllm-gaudi strips GPT-OSS MXFP4 quant configs (and dequantises in load_weights) unless "
                "HPU_MXFP4_NATIVE=1; a table choosing a quantreg method for the key keeps them",
)
"""vllm-gaudi's GPT-OSS MXFP4 switch follows the table (see :mod:`quantreg_hpu_mxfp4.vllm_gaudi`)."""
