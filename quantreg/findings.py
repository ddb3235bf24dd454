"""``quantreg doctor`` findings contributed by plugins (hook ``doctor_findings``).

Core quantreg cannot know what every hardware stack does to a checkpoint (vllm-gaudi strips
GPT-OSS MXFP4 quant configs unless its own switch is set; another plugin may need a driver
version). The plugin that knows the stack says it: each finding is a level, a message and,
when it is about one key, the key. The CLI prints them beside its own warnings.

Hooks are called one plugin at a time, where plugins are loaded
(:func:`quantreg.loading.collect_findings`); a plugin that raises becomes one ``error`` finding
naming it, and the other plugins' findings are kept. This module holds the values only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .keys import EXPERTS, Key, as_key
from .problems import quantreg_logger

if TYPE_CHECKING:
    from .decision import Decision

Resolve = Callable[[Key], "Decision"]
"""What a plugin's ``doctor_findings`` gets to ask the table: a key in, the decision out.

Why a callable and not the :class:`~quantreg.registry.Registry`: the hook API lies under the
registry (the registry calls the hooks), so handing plugins the registry would make the plugin
API depend on everything above it; a plugin needs only the answers.
"""

logger = quantreg_logger("vllm.quantreg")

HOOK = "doctor_findings"
LEVELS = ("info", "warning", "error")


@dataclass(frozen=True)
class Finding:
    """One thing ``quantreg doctor`` reports: ``level`` is ``info``, ``warning`` or ``error``."""

    level: str
    message: str
    key: Key | None = None
    plugin: str = ""

    def __str__(self) -> str:
        where = f"{self.key}: " if self.key is not None else ""
        by = f" [plugin {self.plugin}]" if self.plugin else ""
        return f"{where}{self.message}{by}"

    def as_json(self) -> dict[str, Any]:
        return {"level": self.level, "message": self.message, "plugin": self.plugin,
                "key": _key_list(self.key)}


def _key_list(key: Key | None) -> list[str] | None:
    """A finding's key as a list: three values for the experts (as always), four for another layer kind."""
    if key is None:
        return None
    key = as_key(key)
    return list(key) if key.layer == EXPERTS else [*key, key.layer]


RegisterFinding = Callable[[Finding], None]
