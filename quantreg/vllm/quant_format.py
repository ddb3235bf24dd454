"""The quant format name vLLM will put in the key, asked of vLLM's own quant config classes.

Why: ``config.json`` says ``quant_method: mxfp4`` but the seam sees ``quant_config.get_name()``,
``gpt_oss_mxfp4`` for GPT-OSS. vLLM 0.32 picks the name in ``ModelConfig._verify_quantization``
(``vllm/config/model.py:1370-1440``): every registered method's class is asked
``override_quantization_method(hf_quant_cfg, user_quant, hf_config=...)``, plain methods first
(custom ones at the front), then the "override" methods in a fixed order of preference; the
first non-``None`` answer wins, else the checkpoint's ``quant_method`` stands. The seam's key is
then ``get_quantization_config(name).get_name()``. This module replays that loop without
building a ``ModelConfig`` (no model load, no tokenizer), for ``quantreg plan``.

Only the classes are used (``override_quantization_method`` and ``get_name`` are classmethods);
``get_quantization_config`` imports every quantization module, which costs a few seconds.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

#: The "overrides" list of ``ModelConfig._verify_quantization`` (vllm/config/model.py:1385 in
#: vLLM 0.32), in its order of preference. It is a local variable there, so it is copied here;
#: a name vLLM no longer registers is skipped.
OVERRIDE_ORDER = (
    "auto_gptq", "gptq", "gptq_marlin", "auto_awq", "awq", "awq_marlin", "inc", "moe_wna16", "modelopt",
    "modelopt_fp4", "modelopt_mxfp8", "mxfp8", "modelopt_mixed", "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8",
    "humming",
)


def vllm_quant_format(quant_cfg: dict[str, Any], hf_config: dict[str, Any]) -> tuple[str, str]:
    """``(name, how)``: the key's quant format for this checkpoint, and which class decided it.

    Raises ``ValueError`` when vLLM does not know the checkpoint's ``quant_method`` (vLLM itself
    would refuse the model) and ``ImportError`` when vLLM cannot be imported.
    """
    from vllm import __version__ as vllm_version
    from vllm.model_executor.layers import quantization as me_quant

    supported = list(me_quant.QUANTIZATION_METHODS)
    ordered = [q for q in supported if q not in OVERRIDE_ORDER] + [q for q in OVERRIDE_ORDER if q in supported]
    hf = SimpleNamespace(**hf_config)
    method = str(quant_cfg.get("quant_method", ""))
    how = f"vLLM {vllm_version}: checkpoint quant_method '{method}' kept (no override claimed it)"
    for name in ordered:
        try:
            cls = me_quant.get_quantization_config(name)
            override = cls.override_quantization_method(dict(quant_cfg), None, hf_config=hf)
        except Exception:  # a class that cannot judge this config (missing fields, platform checks)
            continue
        if override is not None:
            how = (f"vLLM {vllm_version}: {cls.__name__}.override_quantization_method "
                   f"maps '{method}' to '{override}'")
            method = str(override)
            break
    if method not in supported:
        raise ValueError(f"vLLM {vllm_version} does not know quant_method '{method}' "
                         f"(known: {', '.join(supported)})")
    cls = me_quant.get_quantization_config(method)
    name = str(cls.get_name())
    if name != method:
        how += f"; {cls.__name__}.get_name() is '{name}'"
    return name, how


#: Used when vLLM is not importable: (checkpoint quant_method, model_type or "*") -> vLLM's name.
#: Read from vLLM 0.32: GptOssMxfp4Config.override_quantization_method
#: (model_executor/layers/quantization/mxfp4.py:129) and GptOssForCausalLMConfig
#: (model_executor/models/config.py:447) claim mxfp4 for gpt_oss; AutoAWQConfig / AutoGPTQConfig
#: report "auto_awq" / "auto_gptq" from get_name() (quantization/__init__.py:160, on CPU; CUDA
#: overrides may pick the *_marlin kernels instead). Anything else keeps its checkpoint name.
QUANT_FORMAT_MAP: dict[tuple[str, str], str] = {
    ("mxfp4", "gpt_oss"): "gpt_oss_mxfp4",
    ("gpt_oss_mxfp4", "*"): "gpt_oss_mxfp4",
    ("awq", "*"): "auto_awq",
    ("gptq", "*"): "auto_gptq",
}


def key_quant_format(quant_cfg: dict[str, Any], hf_config: dict[str, Any], use_vllm: bool | None = None
                     ) -> tuple[str, str, str | None]:
    """``(name, how, problem)``: vLLM's name for the checkpoint's quant method, asked of vLLM's classes
    when vLLM is importable (``use_vllm`` ``None``) or wanted (``True``), else from :data:`QUANT_FORMAT_MAP`.

    ``problem`` is set when vLLM itself does not know the method (it would refuse the model).
    Never raises: a broken vLLM install must not break ``quantreg plan``.
    """
    import importlib.util

    method = str(quant_cfg.get("quant_method", ""))
    model_type = str(hf_config.get("model_type", ""))
    want_vllm = importlib.util.find_spec("vllm") is not None if use_vllm is None else use_vllm
    why_not = "vLLM is not importable here"
    if want_vllm:
        try:
            name, how = vllm_quant_format(quant_cfg, hf_config)
            return name, how, None
        except ValueError as exc:
            return method, f"checkpoint name kept: {exc}", str(exc)
        except Exception as exc:  # a broken vLLM install must not break the plan
            why_not = f"vLLM could not be asked ({type(exc).__name__}: {exc})"
    elif use_vllm is False:
        why_not = "vLLM not consulted on request"
    for (quant, model), name in QUANT_FORMAT_MAP.items():
        if quant == method and model in ("*", model_type):
            return name, f"quantreg.vllm.quant_format.QUANT_FORMAT_MAP ({why_not}): '{method}' -> '{name}'", None
    return method, (f"quantreg.vllm.quant_format.QUANT_FORMAT_MAP ({why_not}): '{method}' not mapped, "
                    "assumed vLLM uses the checkpoint's name"), None
