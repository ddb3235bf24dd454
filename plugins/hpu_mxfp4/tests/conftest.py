"""Fixtures of the plugin's tests: thin wrappers of :mod:`quantreg_hpu_mxfp4.testing`.

``hpu`` installs the Gaudi stack's doubles, ``vllm_gaudi`` vllm-gaudi's, both through the test's
``monkeypatch`` so nothing outlives it; ``gpt_oss_vllm_config`` is a real vLLM config of a tiny GPT-OSS.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from quantreg_hpu_mxfp4.testing import GaudiDoubles, HpuDoubles, install_hpu_doubles, install_vllm_gaudi_doubles

from quantreg.models.gpt_oss import tiny_gpt_oss_config


@pytest.fixture
def hpu(monkeypatch: pytest.MonkeyPatch) -> HpuDoubles:
    return install_hpu_doubles(monkeypatch)


@pytest.fixture
def vllm_gaudi(monkeypatch: pytest.MonkeyPatch) -> GaudiDoubles:
    return install_vllm_gaudi_doubles(monkeypatch)


@pytest.fixture(scope="session")
def gpt_oss_vllm_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real VllmConfig whose model is a tiny GPT-OSS config (no weights, no tokenizer, no network)."""
    from vllm.config import ModelConfig, VllmConfig

    model_dir: Path = tmp_path_factory.mktemp("tiny-gpt-oss")
    config = tiny_gpt_oss_config(hidden=64, intermediate=64, layers=1, experts=8, top_k=2, vocab=128, heads=2,
                                 kv_heads=1, head_dim=32, mxfp4=False)
    (model_dir / "config.json").write_text(json.dumps(config))
    return VllmConfig(model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16"))
