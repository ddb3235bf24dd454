"""Fixtures of the plugin's tests: thin wrappers of :mod:`quantreg_hpu_mxfp4.testing`.

``hpu`` installs the Gaudi stack's doubles, ``vllm_gaudi`` vllm-gaudi's, both through the test's
``monkeypatch`` so nothing outlives it; ``gpt_oss_vllm_config`` is a real vLLM config of a tiny GPT-OSS.

The doubles need torch (as the plugin does), so they are imported by the fixtures that use them:
in an environment without torch (core + plugin #1, issue 31.4) this file still loads and each test
module that needs torch is a skip naming it, not one import error for the whole directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from quantreg.models.gpt_oss import tiny_gpt_oss_config

if TYPE_CHECKING:
    from quantreg_hpu_mxfp4.testing import GaudiDoubles, HpuDoubles


@pytest.fixture
def hpu(monkeypatch: pytest.MonkeyPatch) -> HpuDoubles:
    from quantreg_hpu_mxfp4.testing import install_hpu_doubles

    return install_hpu_doubles(monkeypatch)


@pytest.fixture
def vllm_gaudi(monkeypatch: pytest.MonkeyPatch) -> GaudiDoubles:
    from quantreg_hpu_mxfp4.testing import install_vllm_gaudi_doubles

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
