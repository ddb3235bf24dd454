"""Shadow layers: a second method's view of a vLLM layer that another method owns.

Two features run a second method beside the one vLLM installed on a layer: ``verify:`` (the
``against`` method, :mod:`.verify`) and ``tokens:`` splits (every side after the first,
:mod:`.token_split`). Each needs the same three things, so they live once here:

- a shallow copy of the layer with parameters of its own (:func:`layer_copy`), so what the second
  method sets or registers never lands on the layer vLLM serves;
- what the second method would read from the loaded weights, learnt by letting it create its
  parameters on a copy on the ``meta`` device (:func:`probe_weights`: no memory, no loading);
- a check that those parameters are the ones the layer's method created, with the same shape and
  dtype (:func:`check_layout`), so the second method can share or copy them after loading;
- the containment of the second method's steps (:func:`fault_of`): whatever it raises, ``SystemExit``
  included, is its own failure and never stops the layer the first method serves.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

_MISSING = object()
#: torch.nn.Module's own state and the slot vLLM reads the method from: never a method's extra.
_MODULE_STATE = frozenset({"_parameters", "_buffers", "_modules", "quant_method"})


def layer_copy(layer: Any) -> Any:
    """A shallow copy of a vLLM layer with parameters of its own (none yet) and the same buffers.

    The copy is an instance of the layer's class with the same attributes, so a method reads it as
    it reads the real layer; anything the method sets or registers on it stays on the copy.
    """
    shadow = copy.copy(layer)
    shadow.__dict__["_parameters"] = type(layer._parameters)()
    shadow.__dict__["_buffers"] = type(layer._buffers)(layer._buffers)
    shadow.__dict__["_modules"] = type(layer._modules)(layer._modules)
    return shadow


def probe_weights(method: Any, layer: Any, *args: Any, **kwargs: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    """What ``method`` reads of ``layer`` once loaded: the parameter names its ``create_weights``
    registers, and the attributes it sets that the layer does not already hold (its extras, set
    again on each shadow). Run on a meta-device copy after the layer's own method created the
    real parameters; raises (``ValueError`` from :func:`check_layout`, or whatever the method
    raises) when the method cannot share them."""
    scratch = layer_copy(layer)
    with torch.device("meta"):
        method.create_weights(scratch, *args, **kwargs)
    reads = tuple(scratch._parameters)
    extras = {k: v for k, v in scratch.__dict__.items()
              if k not in _MODULE_STATE and layer.__dict__.get(k, _MISSING) is not v}
    check_layout(scratch, layer)
    return reads, extras


def check_layout(scratch: Any, layer: Any) -> None:
    """The second method must read parameters the layer's method created, with the same shape and dtype."""
    for name, param in scratch._parameters.items():
        have = layer._parameters.get(name)
        if have is None:
            raise ValueError(f"it reads parameter '{name}', which the chosen method did not create "
                             f"(created: {', '.join(layer._parameters) or 'none'})")
        if tuple(have.shape) != tuple(param.shape) or have.dtype != param.dtype:
            raise ValueError(f"parameter '{name}' is {tuple(param.shape)} {param.dtype} for it, "
                             f"{tuple(have.shape)} {have.dtype} for the chosen method")


def fault_of(step: Callable[[], object]) -> BaseException | None:
    """What a second method's ``step`` raised (``SystemExit`` too: it never stops the layer), else ``None``;
    ``KeyboardInterrupt`` passes. The caller turns the fault into its report (verification off, a side dropped)."""
    try:
        step()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return exc
    return None
