"""The built-in plugin: vLLM's own method and the package's default table.

It uses the same hooks as third-party plugins so ``quantreg plugins`` and ``explain`` show
built-ins exactly like everything else. The one difference: the table this plugin registers
forms the ``default`` tier (every other plugin's forms the ``plugin`` tier), which
:func:`quantreg.loading.load` decides by the registering plugin's name, :data:`NAME`.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path

from .hookspecs import hookimpl
from .methods import VLLM_METHOD, Method

NAME = "quantreg.builtin"


def default_table_path() -> Path:
    """The shipped ``registry.yaml`` (a copy of the repository root's file in wheels)."""
    return Path(str(resources.files("quantreg").joinpath("registry.yaml")))


@hookimpl
def register_tables(register: Callable[[Path | str], None]) -> None:
    register(default_table_path())


@hookimpl
def register_methods(register: Callable[[Method], None]) -> None:
    register(
        Method(
            name=VLLM_METHOD,
            target="quantreg.builtin:KeepVllm",
            description="keep the method vLLM itself would build",
            expert_layout="checkpoint",
        )
    )


class KeepVllm:
    """Placeholder target of the ``vllm`` method; the seam never instantiates it."""
