"""Double of ``vllm_gaudi/ops/hpu_mxfp4.py``: rebinds vLLM's GPT-OSS MXFP4 MoE method.

vllm-gaudi defines ``HPUGptOssMxfp4MoEMethod(GptOssMxfp4MoEMethod)`` (native MXFP4 kernel,
used when the quant config flows through, i.e. ``HPU_MXFP4_NATIVE=1``) and assigns it to
``mxfp4.GptOssMxfp4MoEMethod`` so vLLM's factory builds it. The double keeps the rebinding and
the subclassing; building it on CPU records the fact and then fails like the real one would
without Gaudi, so a test can see which class vLLM's factory reached.
"""

import logging

from vllm.model_executor.layers.quantization import mxfp4

logger = logging.getLogger("vllm.vllm_gaudi_double")


class HPUGptOssMxfp4MoEMethod(mxfp4.GptOssMxfp4MoEMethod):
    def __init__(self, moe):
        logger.info("vllm-gaudi double: HPUGptOssMxfp4MoEMethod built")
        raise RuntimeError("vllm-gaudi double: HPUGptOssMxfp4MoEMethod needs a Gaudi (torch.ops.hpu)")


mxfp4.GptOssMxfp4MoEMethod = HPUGptOssMxfp4MoEMethod
