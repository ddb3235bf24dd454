"""Tables written before the layer kind (issue 30) keep their decisions AND their fingerprints.

``snapshot()`` builds, for every table of the repository (the default table, each plugin's packaged
table, the docs' example plugin table, tests/good_tables), a registry with that table in the run
layer and the method names it uses registered by an in-test plugin, then records the fingerprint,
the rules' JSON and the decision (method and winning rule) for every key the tables name (plus
values no table names). ``tests/data/layer_key_golden.json`` is the same function's output on the
code before the layer kind existed (main at d35c799, written by ``python
tests/test_keys_layer_compat.py --write`` with that tree first on ``sys.path``); the test compares
the current code's output with it, key by key.

The golden decisions were taken on a host without AMX (there the built-in limitation passes
``vllm`` over in ``[vllm, cpu_mxfp4]``); both the test and the writer therefore simulate that host
kind (:data:`HOST_KIND`, through the host-facts seam), so the comparison holds on either kind.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from itertools import product
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "data" / "layer_key_golden.json"
TABLES = ("registry.yaml", "plugins/cpu_mxfp4/quantreg_cpu_mxfp4/rules.yaml",
          "plugins/hpu_mxfp4/quantreg_hpu_mxfp4/rules.yaml",
          "docs/examples/quantreg-example-plugin/quantreg_example_plugin/rules.yaml",
          *sorted(f"tests/good_tables/{p.name}" for p in (ROOT / "tests" / "good_tables").glob("*.yaml")))
HOST_KIND = "avx2"
EXTRA = {"quant_format": ("never_named_q", "gpt_oss_mxfp4"), "model_type": ("never_named_m", "gpt_oss"),
         "device": ("never_named_d", "cpu")}


def snapshot(root: Path) -> dict[str, Any]:
    """Fingerprint, rules and decisions per table, with only the API the code before issue 30 had."""
    import quantreg
    from quantreg.keys import FIELDS
    from quantreg.methods import Method
    from quantreg.registry import Registry
    from quantreg.table.file import Tier, read_table, rule_json

    out: dict[str, Any] = {}
    for rel in TABLES:
        path = root / rel
        parsed, problems, _ = read_table(path, Tier.RUN)
        assert parsed is not None, problems
        names = sorted({m for r in parsed.rules for m in r.methods} - {"vllm"})
        values: dict[str, set[str]] = {f: set(EXTRA[f]) for f in FIELDS}
        for rule in parsed.rules:
            for f, v in zip(FIELDS, rule.match.fields()):
                values[f].update(v or ())

        class Methods:
            def __init__(self, names: list[str]) -> None:
                self.names = names

            @quantreg.hookimpl
            def register_methods(self, register: Callable[[Method], None]) -> None:
                for name in self.names:
                    register(Method(name, f"golden_methods:{name.title().replace('_', '')}"))

        registry = Registry.build(config=[path], entry_points=False, plugins=[("golden", Methods(names))],
                                  default_table=root / "registry.yaml")
        assert not registry.faults, registry.faults
        decisions = {}
        for key in product(*(sorted(values[f]) for f in FIELDS)):
            d = registry.resolve(key)
            decisions["|".join(key)] = [d.method, d.source]
        rules = [rule_json(r) for r in registry.index.rules]
        for r in rules:  # install paths differ between the two trees; the fingerprint never sees them
            r["path"] = str(Path(r["path"]).resolve().relative_to(root.resolve()))
        out[rel] = {"fingerprint": registry.fingerprint(), "rules": rules, "decisions": decisions}
    return out


def normalised(data: dict[str, Any], root: Path) -> dict[str, Any]:
    """Decision sources name files under ``root``: relative, so two trees compare."""
    text = json.dumps(data, sort_keys=True).replace(str(root.resolve()) + "/", "").replace(str(root) + "/", "")
    result: dict[str, Any] = _pre_tier(json.loads(text))
    return result


def _pre_tier(value: Any) -> Any:
    """A rule's ``"tier"`` under the key the goldens were written with (``"layer"``, renamed in issue 47:
    the value is the same, and the fingerprint still hashes the old key)."""
    if isinstance(value, list):
        return [_pre_tier(v) for v in value]
    if isinstance(value, dict):
        renamed = {("layer" if k == "tier" and "specificity" in value else k): _pre_tier(v) for k, v in value.items()}
        return renamed
    return value


def test_tables_without_a_layer_key_keep_decisions_and_fingerprints(monkeypatch: pytest.MonkeyPatch) -> None:
    from quantreg.host import simulate

    for name, value in simulate(HOST_KIND).items():
        monkeypatch.setenv(name, value)
    golden = json.loads(GOLDEN.read_text())
    now = normalised(snapshot(ROOT), ROOT)
    assert sorted(now) == sorted(golden)
    for rel in TABLES:
        assert now[rel]["fingerprint"] == golden[rel]["fingerprint"], rel
        assert now[rel]["rules"] == golden[rel]["rules"], rel
        assert now[rel]["decisions"] == golden[rel]["decisions"], rel
        assert len(golden[rel]["decisions"]) >= 8  # the grid really covers keys


if __name__ == "__main__":  # the golden file's writer (see the module docstring)
    if sys.argv[1:] == ["--write"]:
        from quantreg.host import simulate

        os.environ.update(simulate(HOST_KIND))
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(normalised(snapshot(ROOT), ROOT), indent=1, sort_keys=True) + "\n")
