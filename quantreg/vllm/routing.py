"""Expert selection inside a monolithic MoE method: what vLLM's router does that it cannot, the two orders it can.

Why this exists: vLLM calls a monolithic method with raw router logits and lets it pick the
experts; a method that does so with plain softmax + top-k silently picks other experts than vLLM's
router would on a layer whose routing is more than that. :func:`unsupported_routing` names those
features (read from the layer and its ``FusedMoEConfig``) so a method can defer to vLLM's router
(go modular) or refuse (:func:`check_in_method_routing`); :func:`select_in_method` computes the two
orders that are plain softmax + top-k; :func:`local_expert_ids` maps the chosen global ids to an
expert-parallel rank's local ones. vLLM's own router (modular ``apply``) needs none of this.

Imports torch, not vLLM: the layer and config are read by attribute, each with a default, so a
release without a feature reports nothing for it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["IN_METHOD_ORDERS", "InMethodRouting", "check_in_method_routing", "default_order", "local_expert_ids",
           "select_in_method", "to_local", "unsupported_routing"]

#: The orders computed inside a method: top-k of the logits then softmax over k (GPT-OSS's own
#: router), and softmax over all experts, top-k, renormalise (vLLM's default for the others). They
#: pick the same experts; the weights differ by float rounding only (fp32 <= 1.8e-7 measured).
IN_METHOD_ORDERS = ("topk_softmax", "softmax_topk")
_GPT_OSS = "gpt_oss"


def unsupported_routing(moe_config: Any, layer: Any) -> list[str]:
    """What vLLM's router does for this layer that the in-method orders (plain softmax + top-k) do not.

    * hash routing: experts from ``hash_indices_table[input_ids]`` (``FusedMoEConfig.has_hash_routing``
      from 0.32; the table is on the layer from 0.33);
    * scoring functions other than softmax (``scoring_func``: ``sigmoid``, ``sqrtsoftplus``);
    * ``e_score_correction_bias`` added to the scores before top-k (DeepSeek-V3 style);
    * ``routed_scaling_factor`` != 1 applied to the top-k weights (the layer carries 1.0 when vLLM
      applies the factor to the output instead, which the runner does after any method);
    * ``require_decomposed_backend`` (0.33): vLLM adjusts routes after routing, so monolithic
      kernels are refused ("routes adjusted after routing").

    Grouped top-k and custom routing functions are not listed: a method may call a router for
    them or defer them itself. ``layer`` may be ``None`` (not known yet): only ``moe_config`` is
    read then. Each entry is one human-readable phrase, for logs and refusals.
    """
    found: list[str] = []
    if getattr(moe_config, "has_hash_routing", False) or getattr(layer, "hash_indices_table", None) is not None:
        found.append("hash routing (hash_indices_table)")
    scoring = getattr(layer, "scoring_func", "softmax")
    if scoring != "softmax":
        found.append(f"scoring_func={scoring!r} (only softmax is computed in the method)")
    if getattr(layer, "e_score_correction_bias", None) is not None:
        found.append("e_score_correction_bias")
    scale = getattr(layer, "routed_scaling_factor", 1.0)
    if scale is not None and float(scale) != 1.0:
        found.append(f"routed_scaling_factor={float(scale):g}")
    if getattr(moe_config, "require_decomposed_backend", False):
        found.append("require_decomposed_backend (vLLM adjusts routes after routing)")
    return found


def check_in_method_routing(method: str, order: str, prefix: str, unsupported: list[str]) -> None:
    """An explicitly requested in-method ``order`` on a layer whose routing it cannot compute: refuse.

    A ValueError raised while the method is built, naming the method, the layer and the features:
    quantreg's seam then falls back to vLLM's own method (lenient) or stops (strict); a method never
    runs picking other experts than vLLM would. Any other ``order`` (auto, vLLM's router) passes.
    """
    if unsupported and order in IN_METHOD_ORDERS:
        raise ValueError(
            f"{method}: layer '{prefix}' uses {', '.join(unsupported)}, which routing={order!r} (computed inside "
            "the method) does not implement; use routing: auto or vllm to let vLLM's router select the experts")


def default_order(model_type: str | None) -> str:
    """The in-method order a model's own router uses: ``topk_softmax`` for GPT-OSS, else ``softmax_topk``."""
    return IN_METHOD_ORDERS[0] if model_type == _GPT_OSS else IN_METHOD_ORDERS[1]


def select_in_method(order: str, top_k: int, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights ``[T, k]``, global ids ``[T, k]``) from ``router_logits`` ``[T, E]`` in an in-method order."""
    if order == "topk_softmax":
        weights, ids = torch.topk(router_logits, top_k, dim=-1)
        return F.softmax(weights, dim=-1, dtype=torch.float32), ids
    if order == "softmax_topk":
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), ids
    raise ValueError(f"routing order {order!r} is not computed inside the method")


def to_local(topk_ids: torch.Tensor, first_expert: int, num_local: int) -> torch.Tensor:
    """Global ids -> local ids under linear placement (``id - first``); other ranks' ids become -1.

    With ``first_expert == 0`` and ``num_local <= 0`` (no expert parallelism known) the ids are
    returned as int64 unchanged.
    """
    local = topk_ids.to(torch.int64) - first_expert
    if first_expert == 0 and num_local <= 0:
        return local
    return torch.where((local >= 0) & (local < num_local), local, torch.full_like(local, -1))


def local_expert_ids(layer: Any, topk_ids: torch.Tensor) -> torch.Tensor:
    """This rank's local int32 ids for global ``topk_ids``; experts of other ranks become -1 (contribute 0).

    vLLM's ``expert_map`` (global -> local, -1 elsewhere) when the layer has one (expert parallel),
    else the linear placement ``id - ep_rank * local_num_experts``. A method whose kernel takes
    local ids calls this, so its placement is always the one vLLM loaded the weights for.
    """
    expert_map = getattr(layer, "expert_map", None)
    if expert_map is not None:
        return expert_map.to(topk_ids.device)[topk_ids.to(torch.int64)].to(torch.int32)
    num_local = int(layer.local_num_experts)
    first = int(getattr(layer.moe_config, "ep_rank", 0)) * num_local
    return to_local(topk_ids, first, num_local).to(torch.int32)


class InMethodRouting:
    """Mixin for a method that routes inside (monolithic) unless it defers a layer to vLLM's router.

    Why a mixin: vLLM asks the method itself whether it is monolithic, per layer, and a method
    learns what a layer's router does only at build (quantreg's context) or after loading, so the
    answer must follow one attribute. ``_order`` is the order the method computes: an in-method
    order (or the method's own), or ``"vllm"``: modular, vLLM's router picks and ``apply`` gets its
    choice. Put it before vLLM's class in the bases so its ``is_monolithic`` wins.
    """

    _order: str
    apply_monolithic: Any  # the subclass's forward when monolithic

    @property
    def is_monolithic(self) -> bool:
        return self._order != "vllm"

    def _select_monolithic(self) -> Any:
        return self.apply_monolithic

    def defer_unsupported(self, method: str, requested: str, unsupported: list[str], layer_name: str,
                          logger: logging.Logger) -> None:
        """Refuse (``requested`` is an in-method order) or defer to vLLM's router a layer with ``unsupported``.

        Nothing happens when ``unsupported`` is empty; otherwise :func:`check_in_method_routing`
        raises for an explicit in-method order, else ``_order`` becomes ``"vllm"`` and ``logger``
        says so once (an INFO line naming the layer and the features).
        """
        if not unsupported:
            return
        check_in_method_routing(method, requested, layer_name, unsupported)
        if self._order != "vllm":
            self._order = "vllm"
            logger.info("%s: layer '%s' uses %s: vLLM's router selects its experts (modular path)",
                        method, layer_name, ", ".join(unsupported))
