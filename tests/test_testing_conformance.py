"""The plugin author kit (``quantreg.testing``): the conformance suite judged on methods whose verdict is known.

Known good: plugin #1's ``mxfp4_reference`` (passes everything here), ``hpu_mxfp4`` (passes every
device-independent check, the rest SKIPPED with the reason), and the walkthrough's
``example_mxfp4`` (docs/examples). Known bad: the example with exactly one rule of the format
broken (swapped nibbles, concatenated gate/up, ignored w2 bias, wrong EP offset, ...): each must
fail the check that covers that rule, with a message naming what differs, and pass the others.

These tests import vLLM in this process (marked ``vllm``); the kit's checks that need neither torch nor
vLLM are in test_testing_checks_without_vllm.py.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import textwrap
import time
import types
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from core_support import QUANTREG_VARS, ROOT
from kit_support import _Plugin, method, statuses

from quantreg import Registry
from quantreg.cli import main
from quantreg.testing import CHECK_IDS, Status, checks, run_checks

EXAMPLE = ROOT / "docs" / "examples" / "quantreg-example-plugin"
BROKEN = "qrt_conformance_broken"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
F = TypeVar("F", bound=Callable[..., Any])


def needs_vllm(test: F) -> F:
    """Marked ``vllm`` (imports vLLM in this process) and skipped without it."""
    marked: F = pytest.mark.vllm(pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")(test))
    return marked


pytestmark = pytest.mark.usefixtures("clean_env")


# -- with vLLM: fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def example_on_path() -> Iterator[None]:
    """The walkthrough's plugin importable (as if installed), and a module of broken variants of it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLE))
        mp.setitem(sys.modules, BROKEN, _broken_module())
        yield
        for name in [m for m in sys.modules if m.startswith("quantreg_example_plugin")]:
            del sys.modules[name]


def _broken_module() -> types.ModuleType:
    """Variants of the example method, each breaking one rule (defined here, imported by target)."""
    import torch
    from quantreg_example_plugin.method import ExampleMxfp4MoEMethod as Good

    from quantreg.formats.mxfp4 import dequantize_mxfp4

    class SwappedNibbles(Good):  # type: ignore[misc]
        def dequantize(self, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
            return dequantize_mxfp4((blocks << 4) | (blocks >> 4), scales)

    class ConcatenatedGateUp(Good):  # type: ignore[misc]
        def gate_up(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            half = h.shape[1] // 2
            return h[:, :half], h[:, half:]

    class IgnoredW2Bias(Good):  # type: ignore[misc]
        def expert(self, x: torch.Tensor, w13: torch.Tensor, b13: torch.Tensor | None, w2: torch.Tensor,
                   b2: torch.Tensor | None) -> torch.Tensor:
            return super().expert(x, w13, b13, w2, None)

    class WrongEpOffset(Good):  # type: ignore[misc]
        def local_expert_ids(self, layer: Any, topk_ids: torch.Tensor) -> torch.Tensor:
            ids = topk_ids.long()  # global ids used as local slots: rank 1 computes experts 0..3's ids
            return torch.where(ids < layer.local_num_experts, ids, -1)

    class NoClamp(Good):  # type: ignore[misc]
        def activation(self, h: torch.Tensor) -> torch.Tensor:
            gate, up = self.gate_up(h)
            return (up + 1) * gate * torch.sigmoid(self.alpha * gate)

    class AcceptsAnything(Good):  # type: ignore[misc]
        def __init__(self, moe: Any, **options: Any) -> None:
            super().__init__(moe)

    class VagueRejection(Good):  # type: ignore[misc]
        def __init__(self, moe: Any, **options: Any) -> None:
            if options:
                raise ValueError("bad configuration")
            super().__init__(moe)

    class Bf16Blocks(Good):  # type: ignore[misc]
        def create_weights(self, layer: Any, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                           params_dtype: torch.dtype, **extra: Any) -> None:
            super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                                   **extra)
            layer.w13_weight.data = layer.w13_weight.data.to(torch.bfloat16)

    class NoW2BiasParameter(Good):  # type: ignore[misc]
        def create_weights(self, layer: Any, *args: Any, **kwargs: Any) -> None:
            super().create_weights(layer, *args, **kwargs)
            if hasattr(layer, "w2_bias"):
                delattr(layer, "w2_bias")

    class NotFinite(Good):  # type: ignore[misc]
        def apply(self, layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            out: torch.Tensor = super().apply(layer, x, *args, **kwargs)
            out[0, 0] = float("nan")
            return out

    class Float32Output(Good):  # type: ignore[misc]
        def apply(self, layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            out: torch.Tensor = super().apply(layer, x, *args, **kwargs)
            return out.float()

    class Nondeterministic(Good):  # type: ignore[misc]
        """Each call's output depends on how many calls came before (random noise below one bf16
        ULP of the output could round away and make the check itself flaky)."""

        calls = 0

        def apply(self, layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            out: torch.Tensor = super().apply(layer, x, *args, **kwargs)
            self.calls += 1
            return out + self.calls

    class SideEffectKernel(Good):  # type: ignore[misc]
        """Calls Python with a side effect outside any op (a library lookup by file, as plugin #2 did)."""

        def apply(self, layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            os.stat(os.__file__)
            out: torch.Tensor = super().apply(layer, x, *args, **kwargs)
            return out

    class ForwardRaises(Good):  # type: ignore[misc]
        """Builds and loads, then fails where quantreg's seam no longer contains it (issue 46, class 2)."""

        def apply(self, layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            raise RuntimeError("libqrt.so has ABI version 1, this package expects 2")

    class ProcessRaises(Good):  # type: ignore[misc]
        def process_weights_after_loading(self, layer: Any) -> None:
            raise RuntimeError("no kernel for this device")

    class OtherFormat(Good):  # type: ignore[misc]
        quantreg_format = "nvfp4"

    class ZeroTolerance(Good):  # type: ignore[misc]
        quantreg_tolerance = 0

    class NotAMethod:
        def __init__(self, moe: Any) -> None:
            self.moe = moe

    module = types.ModuleType(BROKEN)
    for cls in (SwappedNibbles, ConcatenatedGateUp, IgnoredW2Bias, WrongEpOffset, NoClamp, AcceptsAnything,
                VagueRejection, Bf16Blocks, NoW2BiasParameter, NotFinite, Float32Output, Nondeterministic,
                SideEffectKernel, ForwardRaises, ProcessRaises, OtherFormat, ZeroTolerance, NotAMethod):
        cls.__module__ = BROKEN
        setattr(module, cls.__name__, cls)
    return module


# -- with vLLM: the known good ----------------------------------------------------------------------


@pytest.mark.compat
@needs_vllm
def test_mxfp4_reference_passes_check_method(capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("quantreg_hpu_mxfp4", reason="plugin #1 is not installed")
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    start = time.monotonic()
    code = main(["check-method", "mxfp4_reference", "--device", "cpu", "--json"])
    out = capsys.readouterr().out
    data = json.loads(out)  # stdout carries the JSON only; vLLM's chatter went to stderr
    assert code == 0, out
    assert {r["check"]: r["status"] for r in data["results"]} == dict.fromkeys(CHECK_IDS, "PASS")
    assert data["tolerance"] == 0.01 and data["quant_format"] == "gpt_oss_mxfp4"
    assert time.monotonic() - start < 60
    assert "VLLM_LOGGING_LEVEL" not in os.environ  # quietened for the run only, not for later subprocesses


@needs_vllm
@pytest.mark.parametrize(("device", "reason"), [
    ("cpu", "runs on hpu, not cpu"),
    ("hpu", "requires module 'habana_frameworks', which is not installed"),
])
def test_hpu_mxfp4_passes_device_independent_checks_and_skips_the_rest(
        capsys: pytest.CaptureFixture[str], device: str, reason: str) -> None:
    pytest.importorskip("quantreg_hpu_mxfp4", reason="plugin #1 is not installed")
    code = main(["check-method", "hpu_mxfp4", "--device", device])
    table, err = capsys.readouterr()
    assert code == 0, table
    # a progress line per check that runs, with the shape, on stderr (stdout stays the table)
    ran = re.findall(r"^check-method \[\d+s\]: (\S+) \(shape small\) \.\.\.$", err, re.M)
    assert ran and set(ran) <= {c.id for c in checks.CHECKS} and len(ran) == len(set(ran)), err
    rows = dict(reversed(m.groups()) for m in re.finditer(r"^  (PASS|FAIL|SKIPPED) +(\S+)", table, re.M))
    assert rows == {c.id: "SKIPPED" if c.needs_device else "PASS" for c in checks.CHECKS}, table
    device_checks = sum(c.needs_device for c in checks.CHECKS)
    assert table.count(f"needs a device where 'hpu_mxfp4' runs; on {device}:") == device_checks
    assert reason in " ".join(table.split())
    assert f"{len(checks.CHECKS) - device_checks} passed, 0 failed, {device_checks} skipped" in table


@needs_vllm
@pytest.mark.usefixtures("example_on_path")
def test_example_method_conforms_and_its_rule_options_are_tried(tmp_path: Path) -> None:
    from quantreg_example_plugin import plugin

    registry = Registry.build(entry_points=False, plugins=[("example", plugin)])
    report = run_checks("example_mxfp4", registry=registry)
    assert statuses(report) == dict.fromkeys(CHECK_IDS, Status.PASS), report.render()
    assert "rules.yaml:5: {'compute_dtype': 'bfloat16'}" in report.result("options").detail


@needs_vllm
@pytest.mark.usefixtures("example_on_path")
def test_a_rule_whose_options_do_not_build_fails_at_that_rule(tmp_path: Path) -> None:
    table = tmp_path / "user.yaml"
    table.write_text("version: 1\nrules:\n  - match: {quant_format: gpt_oss_mxfp4, device: cpu}\n"
                     "    method: qrt_m\n    options: {compute_dtype: float16}\n")
    registry = Registry.build(config=[table], entry_points=False, plugins=[("qrt", _Plugin(method()))])
    assert not registry.problems  # the name is declared; only building it shows the value is wrong
    result = run_checks("qrt_m", registry=registry, only=["options"]).result("options")
    assert result.status is Status.FAIL
    assert f"rule {table}:3" in result.detail and "compute_dtype='float16' is not one of" in result.detail


# -- with vLLM: the known bad -----------------------------------------------------------------------

#: class in BROKEN, checks to run, the check that must fail, what its message must say, checks that must pass
BROKEN_CASES: list[tuple[str, tuple[str, ...], str, tuple[str, ...], tuple[str, ...]]] = [
    ("SwappedNibbles", ("forward-bias", "forward-no-bias"), "forward-bias",
     ("decodes MXFP4 nibbles in the wrong order", "LOW nibble of byte j"), ()),
    ("ConcatenatedGateUp", ("forward-bias", "forward-no-bias"), "forward-no-bias",
     ("reads w13 as concatenated halves [gate; up]", "gate = rows 0::2, up = rows 1::2"), ()),
    ("IgnoredW2Bias", ("forward-bias", "forward-no-bias"), "forward-bias",
     ("it ignores the w2 bias", "before the routing weight"), ("forward-no-bias",)),
    ("WrongEpOffset", ("forward-bias", "expert-parallel"), "expert-parallel",
     ("EP rank 1", "without subtracting the rank's first expert"), ("forward-bias",)),
    ("NoClamp", ("forward-bias",), "forward-bias", ("does not clamp in SwiGLU",), ()),
    ("AcceptsAnything", ("unknown-options",), "unknown-options", ("was accepted", "silently ignored"), ()),
    ("VagueRejection", ("unknown-options",), "unknown-options", ("does not name the option",), ()),
    ("Bf16Blocks", ("weights",), "weights", ("'w13_weight' is torch.bfloat16", "copy_ would convert"), ()),
    ("NoW2BiasParameter", ("weights",), "weights", ("no parameter 'w2_bias'",), ()),
    ("NotFinite", ("forward-no-bias",), "forward-no-bias", ("not finite",), ()),
    ("Float32Output", ("forward-no-bias",), "forward-no-bias", ("output dtype torch.float32",), ()),
    ("Nondeterministic", ("deterministic",), "deterministic", ("same layer with identical inputs differ",), ()),
    ("ProcessRaises", ("forward-bias",), "forward-bias", ("RuntimeError: no kernel for this device",), ()),
    ("SideEffectKernel", ("compiled", "forward-bias"), "compiled",
     ("torch.compile(fullgraph=True) of apply failed", "test_testing_conformance.py:", "(in apply)",
      "torch custom op"), ("forward-bias",)),
    ("ForwardRaises", ("first-forward", "weights"), "first-forward",
     ("built and loaded, then its first forward (1 token, top-2) raised RuntimeError: libqrt.so has ABI version 1",
      "(at test_testing_conformance.py:", "in apply)", "in its constructor"), ("weights",)),
    ("ProcessRaises", ("first-forward",), "first-forward",
     ("is available here", "yet loading weights and process_weights_after_loading raised RuntimeError: no kernel "
      "for this device (at test_testing_conformance.py:"), ()),
    ("NotAMethod", ("subclass", "weights"), "subclass", ("vLLM's seam only accepts subclasses",), ()),
]


@needs_vllm
@pytest.mark.usefixtures("example_on_path")
@pytest.mark.parametrize(("cls", "only", "failing", "says", "passing"), BROKEN_CASES,
                         ids=[c[0] + ("-first-forward" if c[2] == "first-forward" else "") for c in BROKEN_CASES])
def test_broken_method_fails_with_a_message_naming_what_differs(
        cls: str, only: tuple[str, ...], failing: str, says: tuple[str, ...], passing: tuple[str, ...]) -> None:
    report = run_checks(method(f"qrt_{cls.lower()}", f"{BROKEN}:{cls}"), only=only)
    result = report.result(failing)
    assert result.status is Status.FAIL, report.render()
    for fragment in says:
        assert fragment in result.detail, result.detail
    for check in passing:
        assert report.result(check).status is Status.PASS, report.render()
    assert not report.ok


@needs_vllm
@pytest.mark.usefixtures("example_on_path")
def test_a_format_the_kit_cannot_feed_is_skipped_and_a_bad_tolerance_fails() -> None:
    report = run_checks(method("qrt_nvfp4", f"{BROKEN}:OtherFormat"))
    skipped = {r.check for r in report.results if r.status is Status.SKIPPED}
    assert skipped == {"weights"} | {c.id for c in checks.CHECKS if c.needs_device}
    assert "no harness for format 'nvfp4'" in report.result("weights").detail and report.ok
    result = run_checks(method("qrt_zero", f"{BROKEN}:ZeroTolerance"), only=["declarations", "subclass"])
    assert result.result("declarations").status is Status.FAIL
    assert "quantreg_tolerance = 0" in result.result("declarations").detail


@needs_vllm
@pytest.mark.usefixtures("example_on_path")
def test_broken_method_that_cannot_run_here_is_skipped_never_passed() -> None:
    gaudi_only = method("qrt_gaudi", f"{BROKEN}:SwappedNibbles", devices=("hpu",))
    report = run_checks(gaudi_only)
    for spec in checks.CHECKS:
        want = Status.SKIPPED if spec.needs_device else Status.PASS
        assert report.result(spec.id).status is want, report.render()
        if spec.needs_device:
            detail = report.result(spec.id).detail
            assert detail == "needs a device where 'qrt_gaudi' runs; on cpu: runs on hpu, not cpu"


# -- the pytest plugin ------------------------------------------------------------------------------

PYTEST_FILE = '''
import pytest
from quantreg import Method, Registry, hookimpl


class Plugin:
    @hookimpl
    def register_methods(self, register):
        for name, target, devices in [
                ("qrt_good", "quantreg_example_plugin.method:ExampleMxfp4MoEMethod", ("cpu",)),
                ("qrt_nibbles", "{broken}:SwappedNibbles", ("cpu",)),
                ("qrt_gaudi", "{broken}:SwappedNibbles", ("hpu",))]:
            register(Method(name=name, target=target, devices=devices, requires=("torch", "vllm"),
                            options=("compute_dtype",)))


@pytest.fixture(scope="session")
def quantreg_registry():
    return Registry.build(entry_points=False, plugins=[("qrt", Plugin())])


@pytest.mark.quantreg_method("qrt_good", "qrt_nibbles", "qrt_gaudi")
def test_conformance(quantreg_check):
    quantreg_check()


@pytest.mark.quantreg_method("qrt_nibbles")
def test_body_forgets_to_call(quantreg_check):
    pass


def test_no_method_named(quantreg_check):
    quantreg_check()
'''


def pytest_plugin_args() -> list[str]:
    """``-p quantreg.testing.pytest_plugin`` unless the pytest11 entry point already loads it."""
    installed = any(ep.value == "quantreg.testing.pytest_plugin"
                    for ep in importlib.metadata.entry_points(group="pytest11"))
    return [] if installed else ["-p", "quantreg.testing.pytest_plugin"]


@needs_vllm
@pytest.mark.usefixtures("example_on_path")
def test_pytest_plugin_turns_checks_into_items(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    test_file = tmp_path / "test_qrt_kit_items.py"
    test_file.write_text(textwrap.dedent(PYTEST_FILE).replace("{broken}", BROKEN))
    junit = tmp_path / "junit.xml"
    monkeypatch.chdir(tmp_path)
    for var in QUANTREG_VARS:
        monkeypatch.delenv(var, raising=False)
    code = pytest.main([*pytest_plugin_args(), "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                        "--rootdir", str(tmp_path), str(test_file)])
    sys.modules.pop("test_qrt_kit_items", None)
    outcomes: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kind = next((child.tag for child in case if child.tag in ("failure", "skipped", "error")), "passed")
        message = next((child.get("message", "") for child in case if child.tag == kind), "")
        outcomes[case.get("name", "")] = (kind, message)
    assert code == pytest.ExitCode.TESTS_FAILED
    assert all(outcomes[f"test_conformance[qrt_good-{c}]"][0] == "passed" for c in CHECK_IDS), outcomes
    kind, message = outcomes["test_conformance[qrt_nibbles-forward-bias]"]
    assert kind == "failure" and "nibbles in the wrong order" in message
    assert outcomes["test_conformance[qrt_nibbles-weights]"][0] == "passed"
    kind, message = outcomes["test_conformance[qrt_gaudi-expert-parallel]"]
    assert kind == "skipped" and "runs on hpu, not cpu" in message
    assert outcomes["test_body_forgets_to_call[qrt_nibbles-forward-no-bias]"][0] == "failure"
    kind, message = outcomes["test_no_method_named[no-method-named]"]
    assert kind == "error" and "@pytest.mark.quantreg_method" in message  # a set-up mistake, not a verdict
