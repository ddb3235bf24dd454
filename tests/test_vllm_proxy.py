"""quantreg.vllm.proxy: the one base for an object standing in for vLLM's method.

What vLLM does with a quant method it holds (reads and writes attributes, ``isinstance``,
``quant_method.__class__.__name__``, properties of its base class found before ``__getattr__``)
must reach the method stood in for; the proxy's own state must stay on the proxy. The first tests use
a plain base class (no vLLM needed); the last reads vLLM's own base classes and quantreg's three
proxies (``verify:``, a split, the dense ``verify:``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from quantreg.vllm.proxy import Proxy


class Base:
    """Stands for vLLM's base class: a class attribute and a property a subclass overrides."""

    flag = "base's"

    @property
    def is_monolithic(self) -> bool:
        return False

    def apply(self) -> str:
        return "base apply"

    def get_config(self) -> str:
        return "base config"


class Target(Base):
    flag = "target's"
    is_monolithic = True  # type: ignore[assignment]  # a plain value where the base has a property

    def __init__(self) -> None:
        self.moe_quant_config: object = None

    def get_config(self) -> str:
        return "target config"


class Standing(Proxy, Base, forwards=Base):
    _quantreg_own = frozenset({"_quantreg_target_object", "_quantreg_calls"})

    def __init__(self, target: Target) -> None:
        self._quantreg_target_object = target
        self._quantreg_calls = 0

    def _quantreg_target(self) -> Any:
        return self._quantreg_target_object

    def apply(self) -> str:  # a lifecycle point the proxy changes: its own, not forwarded
        self._quantreg_calls += 1
        return "proxy: " + self._quantreg_target_object.apply()


class Unforwarded(Proxy, Base):
    """Without ``forwards=``: what the base class defines is found before ``__getattr__`` (the old bug)."""

    _quantreg_own = frozenset({"_t"})

    def __init__(self, target: Target) -> None:
        self._t = target

    def _quantreg_target(self) -> Any:
        return self._t


def test_the_base_class_attributes_are_the_targets() -> None:
    target = Target()
    proxy = Standing(target)
    assert proxy.flag == "target's" and proxy.is_monolithic is True and proxy.get_config() == "target config"
    # the point of forwards=: without it the base class answers for the target
    plain = Unforwarded(target)
    assert plain.flag == "base's" and plain.is_monolithic is False and plain.get_config() == "base config"


def test_reads_writes_and_deletes_reach_the_target_own_state_stays() -> None:
    target = Target()
    proxy = Standing(target)
    proxy.moe_quant_config = "set by vLLM"
    assert target.moe_quant_config == "set by vLLM" and "moe_quant_config" not in vars(proxy)
    target.topk_indices_dtype = "int32"  # type: ignore[attr-defined]
    assert proxy.topk_indices_dtype == "int32"  # type: ignore[attr-defined]
    del proxy.topk_indices_dtype  # type: ignore[attr-defined]
    assert not hasattr(target, "topk_indices_dtype")
    assert proxy.apply() == "proxy: base apply" and proxy._quantreg_calls == 1
    assert vars(proxy) == {"_quantreg_target_object": target, "_quantreg_calls": 1}
    with pytest.raises(AttributeError):
        proxy.missing_everywhere  # noqa: B018  # type: ignore[attr-defined]


def test_the_class_vllm_sees_is_the_targets() -> None:
    proxy = Standing(Target())
    assert proxy.__class__ is Target and proxy.__class__.__name__ == "Target"
    assert isinstance(proxy, Target) and isinstance(proxy, Standing)
    assert type(proxy) is Standing  # quantreg's own code and the trail name the proxy


def test_an_own_attribute_not_yet_set_is_missing_not_a_recursion() -> None:
    proxy = Standing.__new__(Standing)  # as unpickling makes it: no target yet
    with pytest.raises(AttributeError):
        proxy._quantreg_target_object  # noqa: B018


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_quantregs_proxies_forward_every_attribute_of_vllms_base() -> None:
    """Each proxy's class answers every public attribute of vLLM's base class with the target's,
    except the lifecycle points it defines itself (read from the real classes)."""
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.linear import LinearMethodBase

    from quantreg.vllm.dense_verify import VerifyingDense
    from quantreg.vllm.token_split import TokenSplitMethod
    from quantreg.vllm.verify import VerifyingMethod

    for proxy, base in ((VerifyingMethod, FusedMoEMethodBase), (TokenSplitMethod, FusedMoEMethodBase),
                        (VerifyingDense, LinearMethodBase)):
        assert issubclass(proxy, Proxy) and issubclass(proxy, base)
        names = [n for n in dir(base) if not n.startswith("__") and not n.startswith("_abc")]
        assert len(names) >= 4, (proxy, names)
        own = [n for n in names if n in proxy.__dict__ and not isinstance(proxy.__dict__[n], property)]
        assert {"create_weights", "process_weights_after_loading", "apply"} <= set(own), (proxy, own)
        for name in names:
            found = proxy.__dict__.get(name)
            assert found is not None, (proxy.__name__, name)  # forwarded or its own: never the base's
