"""Double of vllm-gaudi's package entry points (``vllm_gaudi/__init__.py`` at 091bbadd).

Same function names as the real package; only the GPT-OSS MXFP4 parts are reproduced. The
register functions print (vLLM's log handler does not show INFO lines this early in the
driver); ``register_utils`` also prints the ``vllm.general_plugins`` names in discovery order,
found with the same ``importlib.metadata.entry_points`` call vLLM's loader iterates.
"""

import os
import sys


def _say(text):
    print(f"vllm-gaudi double: {text} (pid {os.getpid()})", file=sys.stderr, flush=True)


def register():
    """Platform plugin: vllm-gaudi returns its HpuPlatform; there is no Gaudi here."""
    return None


def register_utils():
    from importlib.metadata import entry_points

    names = [ep.name for ep in entry_points(group="vllm.general_plugins")]
    _say(f"general plugins in discovery order: {','.join(names)}")
    _say("01.hpu_custom_utils")


def register_ops():
    import vllm_gaudi.ops.hpu_mxfp4  # noqa: F401

    _say("02.hpu_custom_ops rebound mxfp4.GptOssMxfp4MoEMethod")


def register_models():
    import vllm_gaudi.models.gptoss_mxfp4  # noqa: F401

    from .models import register_model

    register_model()
    _say("03.hpu_custom_models patched GPT-OSS MXFP4 loading")


def register_tool_parsers():
    _say("04.hpu_tool_parsers")
