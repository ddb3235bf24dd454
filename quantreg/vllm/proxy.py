"""The one base for every object that stands in for a method vLLM holds: it *is* that method to vLLM.

Why one base: quantreg puts objects of its own where vLLM expects a quant method (the ``verify:``
wrapper, :class:`~.verify.VerifyingMethod`; a token split, :class:`~.token_split.TokenSplitMethod`;
the dense ``verify:`` wrapper, :class:`~.dense_verify.VerifyingDense`). vLLM reads and writes the
method's attributes (``moe_quant_config``, ``topk_indices_dtype``, ``is_monolithic``,
``supports_internal_mk``, ...), asks ``isinstance()`` and reads ``quant_method.__class__.__name__``
(its weight loaders). Each of those must reach the method stood in for, or vLLM takes a path for a
method that is not running. The forwarding was hand-written twice, with a third partial copy; it is
written once here:

* an attribute the proxy does not hold itself (its class's ``_quantreg_own`` names) is read,
  written and deleted on the target (:meth:`Proxy._quantreg_target`);
* ``__class__`` is the target's class (``type()`` still names the proxy: what quantreg's own code and
  tests read);
* attributes vLLM's base class defines (properties and class attributes such as ``is_monolithic``)
  are found on the class *before* ``__getattr__`` is asked, so each one a subclass does not define
  itself is made a property of the target's: ``class P(Proxy, FusedMoEMethodBase,
  forwards=FusedMoEMethodBase)``.

A subclass says only what differs: which object it stands in for, which names are its own, and the
lifecycle points it defines (``create_weights``, ``process_weights_after_loading``, ``apply``, ...).

No torch, no vLLM: the base class to forward is the subclass's.
"""

from __future__ import annotations

from typing import Any, ClassVar


class Proxy:
    """Stands in for :meth:`_quantreg_target`: every attribute but its own (``_quantreg_own``) is the target's."""

    _quantreg_own: ClassVar[frozenset[str]] = frozenset()
    """Attribute names kept on the proxy itself (its state); everything else is the target's."""

    def __init_subclass__(cls, forwards: type[Any] | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if forwards is None:
            return
        # found on the class before __getattr__ is asked: made the target's, except what the subclass defines
        for name in dir(forwards):
            if not name.startswith("__") and not name.startswith("_abc") and name not in cls.__dict__:
                setattr(cls, name, _forwarded(name))

    def _quantreg_target(self) -> Any:
        """The method object this proxy stands in for (read at every access: a split's first side may change)."""
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        if name in type(self)._quantreg_own:  # not yet set (during unpickling or a failed __init__)
            raise AttributeError(name)
        return getattr(self._quantreg_target(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in type(self)._quantreg_own:
            object.__setattr__(self, name, value)
        else:  # vLLM sets e.g. quant_method.moe_quant_config: that is the target's state
            setattr(self._quantreg_target(), name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._quantreg_target(), name)

    def _target_class(self) -> type[Any]:
        return type(self._quantreg_target())

    # vLLM reads quant_method.__class__.__name__ (weight loaders) and isinstance(): both see the target's class.
    __class__ = property(_target_class)


def _forwarded(name: str) -> property:
    def get(self: Proxy) -> Any:
        return getattr(self._quantreg_target(), name)

    def set_(self: Proxy, value: Any) -> None:
        setattr(self._quantreg_target(), name, value)

    return property(get, set_, doc=f"the {name} of the method stood in for")
