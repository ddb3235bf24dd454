"""``quantreg tiny-model --planted``: the planted structure is there, deterministic, and on top of the plain weights."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from quantreg.models.gpt_oss import tiny_gpt_oss_config  # noqa: E402
from quantreg.tiny.checkpoint import tiny_gpt_oss_tensors  # noqa: E402
from quantreg.tiny.planted import (  # noqa: E402
    CLAMP_ROWS,
    MASSIVE_VALUES,
    OUTLIER_SCALE,
    T_ROWS,
    planted_spec,
    trigger_tokens,
)

CONFIG = tiny_gpt_oss_config(hidden=256, intermediate=128, layers=2, experts=4, vocab=1024)


def test_planted_is_deterministic_and_leaves_the_plain_draws_alone() -> None:
    plain = tiny_gpt_oss_tensors(CONFIG, seed=3)
    a = tiny_gpt_oss_tensors(CONFIG, seed=3, planted=True)
    b = tiny_gpt_oss_tensors(CONFIG, seed=3, planted=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # what is not planted is bit-identical to the plain checkpoint (the plants use their own generator)
    for name in ("model.layers.0.mlp.experts.gate_up_proj_blocks", "model.layers.1.self_attn.sinks",
                 "model.norm.weight", "model.layers.0.mlp.experts.down_proj_bias"):
        assert torch.equal(plain[name], a[name]), name
    assert not torch.equal(plain["lm_head.weight"], a["lm_head.weight"])
    other = tiny_gpt_oss_tensors(CONFIG, seed=4, planted=True)
    assert not torch.equal(other["lm_head.weight"], a["lm_head.weight"])


def test_massive_activations_outlier_dims_heavy_rows_and_clamp_rows() -> None:
    plain = tiny_gpt_oss_tensors(CONFIG, seed=0)
    planted = tiny_gpt_oss_tensors(CONFIG, seed=0, planted=True)
    spec = planted_spec(CONFIG)
    embed = planted["model.embed_tokens.weight"].float()
    assert spec["massive"]["tokens"] == list(trigger_tokens(1024)) == [1021, 13, 11, 198]
    for token in spec["massive"]["tokens"]:
        assert embed[token, spec["massive"]["dims"]].tolist() == list(MASSIVE_VALUES)
        assert embed[token].abs().max() / embed[token].abs().median() > 300
    outliers = spec["outlier_features"]["dims"]
    ratio = embed[:, outliers].std() / plain["model.embed_tokens.weight"].float()[:, outliers].std()
    assert abs(ratio / OUTLIER_SCALE - 1) < 0.05
    # heavy-tailed rows: some rows' kurtosis far above a Gaussian's 3, about T_ROWS of them changed
    q = planted["model.layers.0.self_attn.q_proj.weight"].float()
    changed = (q != plain["model.layers.0.self_attn.q_proj.weight"].float()).any(dim=1).float().mean()
    assert T_ROWS <= changed <= T_ROWS + 1 / 32
    z = (q - q.mean(dim=1, keepdim=True)) / q.std(dim=1, keepdim=True)
    assert float((z ** 4).mean(dim=1).max()) > 6
    # clamp rows: about CLAMP_ROWS of gate_up rows with scales raised by 2
    name = "model.layers.0.mlp.experts.gate_up_proj_scales"
    raised = (planted[name].int() - plain[name].int() >= 2).all(dim=-1).float().mean()
    assert CLAMP_ROWS <= raised <= CLAMP_ROWS + 1 / 32
