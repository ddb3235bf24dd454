"""The conformance suite: what every quantreg MoE method must do, checked against real vLLM layers.

A method is judged by what vLLM and quantreg will do with it, not by its own tests:

* **registered** -- some installed plugin registers it (or the caller passes a :class:`Method`);
* **subclass** -- its target imports and subclasses vLLM's ``FusedMoEMethodBase`` (the seam
  refuses anything else);
* **declarations** -- devices, requirements and options are declared, so quantreg can rule it
  out cheaply and reject a table naming an option it does not take before vLLM starts;
* **probe** -- the availability probe answers ``(bool, reason)`` within 5 s and never raises
  (quantreg calls it while vLLM builds the model);
* **options** -- ``cls(moe_config, **options)`` works with no options and with the options of
  every rule that names the method; **unknown-options** -- an unknown option is rejected, with a
  message naming it (a typo must not be silently ignored);
* **weights** -- ``create_weights`` registers the parameters vLLM's GPT-OSS MXFP4 loader writes
  (names, dtypes, at least the loaded shapes; the leading dim is the rank's expert count), and
  the loader's writes succeed, with and without biases and on an EP rank;
* **forward-bias / forward-no-bias** -- after ``process_weights_after_loading``, outputs for 1, 7
  and 64 tokens and top-k 1..4 have the input's shape and dtype, are finite, and are within the
  declared tolerance of the float64 reference (:mod:`quantreg.models.gpt_oss_moe`);
* **expert-parallel** -- ranks 0 and 1 of 2 each give the partial sum of their own experts;
* **deterministic** -- identical inputs give bit-identical outputs, on the same layer (with
  other calls in between) and on a second layer loaded with the same weights.

The last four need the method to run here: when ``Method.availability(device)`` says no they
are SKIPPED with its reason, never passed; everything else is checked anyway (construction,
``create_weights`` and loading do not touch the device's kernels). A method declares its
weight format and tolerance as class attributes ``quantreg_format`` (default and, so far, only
``"gpt_oss_mxfp4"``) and ``quantreg_tolerance`` (default 1e-2, measured as
``max |out - ref| / max |ref|``).

This module imports neither torch nor vLLM at import time; :func:`run_checks` imports them.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import re
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..keys import WILDCARD
from ..methods import VLLM_METHOD, Availability, Method, check_specifier, load_object
from ..problems import did_you_mean
from ..registry import Registry
from .report import CheckResult, Report, Status

if TYPE_CHECKING:
    from ..models.gpt_oss_moe import GptOssMxfp4Experts
    from .diagnose import Case
    from .harness import MoeLayer, VllmMoeHarness

DEFAULT_FORMAT = "gpt_oss_mxfp4"
SUPPORTED_FORMATS = (DEFAULT_FORMAT,)
DEFAULT_TOLERANCE = 1e-2
"""``max |out - ref| / max |ref|``. bf16 activations and outputs cost ~0.5 %; every classic mistake
moves the output by more than 15 % on the kit's weights (see ``random_gpt_oss_mxfp4_experts``)."""
PROBE_BUDGET_S = 5.0
TOKENS = (1, 7, 64)
TOP_KS = (1, 2, 3, 4)
EP_SIZE = 2
EP_TOP_KS = (1, 4)
EP_TOKENS = (7, 64)
UNKNOWN_OPTION = "quantreg_conformance_unknown_option"
_DEVICE_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(frozen=True)
class CheckSpec:
    id: str
    title: str
    needs_device: bool = False


CHECKS: tuple[CheckSpec, ...] = (
    CheckSpec("registered", "registered with quantreg"),
    CheckSpec("subclass", "subclasses vLLM's FusedMoEMethodBase"),
    CheckSpec("declarations", "declares devices, requirements and options"),
    CheckSpec("probe", "availability probe answers quickly and never raises"),
    CheckSpec("options", "builds with the options its rules pass"),
    CheckSpec("unknown-options", "rejects unknown options with a clear message"),
    CheckSpec("weights", "create_weights makes what vLLM's GPT-OSS MXFP4 loader writes"),
    CheckSpec("forward-bias", "matches the float64 reference, with biases", True),
    CheckSpec("forward-no-bias", "matches the float64 reference, without biases", True),
    CheckSpec("expert-parallel", "EP ranks 0 and 1 of 2 give their partial sums", True),
    CheckSpec("deterministic", "identical inputs give bit-identical outputs", True),
)
CHECK_IDS: tuple[str, ...] = tuple(c.id for c in CHECKS)
CLASS_CHECKS: tuple[str, ...] = CHECK_IDS[CHECK_IDS.index("subclass"):CHECK_IDS.index("declarations")] + CHECK_IDS[
    CHECK_IDS.index("options"):]
"""The checks that import the method's class (and with it torch and vLLM)."""
_SPECS = {c.id: c for c in CHECKS}


class _Outcome(Exception):
    """Ends a check early with its result (raised by :func:`_fail` / :func:`_skip`)."""

    def __init__(self, status: Status, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def _fail(detail: str) -> _Outcome:
    return _Outcome(Status.FAIL, detail)


def _skip(detail: str) -> _Outcome:
    return _Outcome(Status.SKIPPED, detail)


def describe_exception(exc: BaseException) -> str:
    """``Type: message (at file.py:LINE in func)``: enough to find the line without a traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    if frames:
        last = frames[-1]
        where = f" (at {os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}{' ...' if len(text) > 1 else ''}{where}"


def rule_option_sets(registry: Registry | None, name: str) -> list[tuple[str, dict[str, Any]]]:
    """``(where, options)`` to build the method with: none, then each rule naming it that passes options."""
    sets: list[tuple[str, dict[str, Any]]] = [("no options", {})]
    if registry is None:
        return sets
    for rule in registry.index.rules:
        if name in rule.methods and rule.options:
            opts = dict(rule.options)
            if all(opts != seen for _, seen in sets):
                sets.append((f"rule {rule.location}", opts))
    return sets


class _Run:
    """One conformance run: state shared by the checks of one method on one device."""

    def __init__(self, method: Method, registry: Registry | None, device: str, tolerance: float | None,
                 option_sets: Sequence[Mapping[str, Any]], only: set[str], harness: VllmMoeHarness | None) -> None:
        self.method = method
        self.registry = registry
        self.device = device
        self.tolerance_override = tolerance
        self.extra_option_sets = [dict(o) for o in option_sets]
        self.only = only
        self.results: dict[str, CheckResult] = {}
        self.availability: Availability = method.availability(device)
        self.cls: type[Any] | None = None
        self.tolerance = DEFAULT_TOLERANCE
        self.quant_format = DEFAULT_FORMAT
        self._harness = harness
        self._own_harness = False
        self._blocked: str | None = None  # why checks needing the class cannot run
        self._pass_detail = ""

    # -- plumbing ---------------------------------------------------------------------------------
    def record(self, check: str, status: Status, detail: str) -> None:
        spec = _SPECS[check]
        if check in self.only:
            self.results[check] = CheckResult(check, spec.title, status, detail, spec.needs_device)

    @contextlib.contextmanager
    def check(self, check: str) -> Iterator[None]:
        """Run a check's body: a normal return is PASS with the detail set by :meth:`passed`,
        :class:`_Outcome` is FAIL/SKIPPED, any other exception is a FAIL that names it."""
        self._pass_detail = ""
        try:
            yield
        except _Outcome as outcome:
            self.record(check, outcome.status, outcome.detail)
        except Exception as exc:
            self.record(check, Status.FAIL, f"raised {describe_exception(exc)}")
        else:
            self.record(check, Status.PASS, self._pass_detail)

    def passed(self, detail: str) -> None:
        self._pass_detail = detail

    def wanted(self, *checks: str) -> bool:
        return any(c in self.only for c in checks)

    def skip_rest(self, reason: str) -> None:
        for spec in CHECKS:
            if spec.id not in self.results and spec.id in self.only:
                self.record(spec.id, Status.SKIPPED, reason)

    @property
    def harness(self) -> VllmMoeHarness:
        """Layers live on the device when the method runs there; otherwise the device-independent
        checks (construction, ``create_weights``, loading) use CPU tensors."""
        wanted = self.device if self.availability.ok else "cpu"
        if self._harness is None or self._harness.device != wanted:
            from .harness import VllmMoeHarness

            self.close()
            self._harness = VllmMoeHarness(wanted)
            self._own_harness = True
        return self._harness

    def close(self) -> None:
        if self._own_harness and self._harness is not None:
            self._harness.close()
            self._harness, self._own_harness = None, False

    def factory(self, options: Mapping[str, Any] | None = None) -> Any:
        from .harness import method_factory

        assert self.cls is not None
        return method_factory(self.cls, options)

    @property
    def device_reason(self) -> str:
        return f"needs a device where '{self.method.name}' runs; on {self.device}: {self.availability.reason}"

    # -- the checks -------------------------------------------------------------------------------
    def run(self) -> None:
        self.declarations()
        self.probe()
        if not self.wanted(*CLASS_CHECKS) or not self.load_class():
            return
        if self.wanted("options"):
            self.options()
        if self.wanted("unknown-options"):
            self.unknown_options()
        if self.quant_format not in SUPPORTED_FORMATS:
            return  # load_class reported the format's checks as skipped
        if self.wanted("weights"):
            self.weights()
        device_checks = ("forward-bias", "forward-no-bias", "expert-parallel", "deterministic")
        if not self.availability.ok:
            for name in device_checks:
                self.record(name, Status.SKIPPED, self.device_reason)
            return
        for bias in (True, False):
            if self.wanted("forward-bias" if bias else "forward-no-bias"):
                self.forward(bias)
        if self.wanted("expert-parallel"):
            self.expert_parallel()
        if self.wanted("deterministic"):
            self.deterministic()

    def declarations(self) -> None:
        m = self.method
        with self.check("declarations"):
            problems = []
            if not m.devices:
                problems.append("devices is empty: name the devices it runs on, or ('*',) for any")
            for d in m.devices:
                if d != WILDCARD and not _DEVICE_RE.match(d):
                    problems.append(f"device {d!r} is not a vLLM device type such as 'cpu', 'cuda', 'hpu'")
            for r in m.requires:
                if not isinstance(r, str) or not _MODULE_RE.match(r):
                    problems.append(f"requires entry {r!r} is not a module name")
            if m.options is None:
                problems.append("options is None (accepts anything): declare the option names, () for none, so a "
                                "table with a misspelt option is rejected when it is loaded, not when vLLM builds "
                                "the model")
            if m.vllm_version and (bad := check_specifier(m.vllm_version)):
                problems.append(f"vllm_version: {bad}")
            if problems:
                raise _fail("; ".join(problems))
            probe = m.probe if isinstance(m.probe, str) or m.probe is None else getattr(m.probe, "__qualname__", "?")
            self.passed(f"devices {', '.join(m.devices)}; requires {', '.join(m.requires) or 'nothing'}; "
                        f"probe {probe or 'none (devices and requires decide)'}; "
                        f"options {', '.join(m.options or ()) or 'none'}"
                        + (f"; vLLM {m.vllm_version}" if m.vllm_version else ""))

    def probe(self) -> None:
        m = self.method
        with self.check("probe"):
            if m.probe is None:
                here = "available" if self.availability.ok else "not available"
                self.passed(f"no probe: devices and requires decide ({here} on {self.device})")
                return
            box: dict[str, Any] = {}

            def call() -> None:
                try:
                    fn = load_object(m.probe) if isinstance(m.probe, str) else m.probe
                    box["value"] = fn()  # type: ignore[misc]
                except BaseException as exc:
                    box["error"] = exc

            start = time.monotonic()
            thread = threading.Thread(target=call, name="quantreg-probe", daemon=True)
            thread.start()
            thread.join(PROBE_BUDGET_S)
            elapsed = time.monotonic() - start
            if thread.is_alive():
                raise _fail(f"no answer within {PROBE_BUDGET_S:g} s; quantreg calls the probe while vLLM builds "
                            "the model, so it must answer quickly (check for the device, do not initialise it)")
            if "error" in box:
                raise _fail(f"raised {describe_exception(box['error'])}; a probe must return (False, reason) "
                            "instead of raising")
            value = box.get("value")
            if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], bool)
                    and isinstance(value[1], str)):
                raise _fail(f"returned {value!r}; a probe returns (ok: bool, reason: str)")
            if not value[1].strip():
                raise _fail("returned an empty reason; `quantreg explain` shows it to users")
            self.passed(f"answered in {elapsed * 1000:.0f} ms: ({value[0]}, {value[1]!r})")

    def load_class(self) -> bool:
        """Import the stack and the target; False if the remaining checks cannot run."""
        m = self.method
        try:
            importlib.import_module("torch")
            fused_moe = importlib.import_module("vllm.model_executor.layers.fused_moe")
        except Exception as exc:
            self.skip_rest(f"vLLM is not importable here ({describe_exception(exc)})")
            return False
        base = fused_moe.FusedMoEMethodBase
        with self.check("subclass"):
            try:
                obj = load_object(m.target)
            except Exception as exc:
                if not self.availability.ok:
                    self._blocked = (f"cannot import {m.target} ({describe_exception(exc)}); "
                                     f"'{m.name}' is not available on {self.device}: {self.availability.reason}")
                    raise _skip(self._blocked) from exc
                self._blocked = f"its target {m.target} does not import"
                raise _fail(f"importing {m.target} failed although the method is available here: "
                            f"{describe_exception(exc)}") from exc
            if not isinstance(obj, type):
                self._blocked = f"its target {m.target} is not a class"
                raise _fail(f"{m.target} is a {type(obj).__name__}, not a class")
            if not issubclass(obj, base):
                self._blocked = f"{m.target} is not a FusedMoEMethodBase"
                bases = ", ".join(f"{b.__module__}.{b.__qualname__}" for b in obj.__mro__[1:-1]) or "object"
                raise _fail(f"{m.target} derives from {bases}; vLLM's seam only accepts subclasses of "
                            "vllm.model_executor.layers.fused_moe.FusedMoEMethodBase")
            self.cls = obj
            self.passed(f"{obj.__module__}.{obj.__qualname__} <- "
                        + " <- ".join(b.__qualname__ for b in obj.__mro__[1:] if issubclass(b, base)))
        if self.cls is None:
            self.skip_rest(f"not checked: {self._blocked}")
            return False
        fmt = getattr(self.cls, "quantreg_format", DEFAULT_FORMAT)
        tol = self.tolerance_override if self.tolerance_override is not None else getattr(
            self.cls, "quantreg_tolerance", DEFAULT_TOLERANCE)
        if not isinstance(tol, (int, float)) or isinstance(tol, bool) or not math.isfinite(tol) or tol <= 0:
            problem = (f"quantreg_tolerance = {tol!r}; declare a positive number (the max |out - ref| / max |ref| "
                       "the method guarantees)")
            earlier = self.results.get("declarations")
            if earlier is not None and earlier.status is Status.FAIL:
                problem = f"{earlier.detail}; {problem}"
            self.record("declarations", Status.FAIL, problem)
            tol = DEFAULT_TOLERANCE
        self.tolerance, self.quant_format = float(tol), str(fmt)
        if self.quant_format not in SUPPORTED_FORMATS:
            reason = (f"the kit has no harness for format '{self.quant_format}' (quantreg_format); "
                      f"it checks: {', '.join(SUPPORTED_FORMATS)}")
            for name in ("weights", "forward-bias", "forward-no-bias", "expert-parallel", "deterministic"):
                self.record(name, Status.SKIPPED, reason)
        return True

    def options(self) -> None:
        assert self.cls is not None
        sets = rule_option_sets(self.registry, self.method.name)
        sets += [("the caller", o) for o in self.extra_option_sets]
        with self.check("options"):
            config = self.harness.moe_config()
            built = []
            for where, opts in sets:
                try:
                    with self.harness.context():
                        self.cls(config, **opts)
                except Exception as exc:
                    raise _fail(f"{self.cls.__name__}(moe_config, **{opts!r}) (options from {where}) raised "
                                f"{describe_exception(exc)}; every option must have a default, and every option "
                                "a rule passes must build") from exc
                built.append(f"{where}: {opts}" if opts else where)
            self.passed(f"built with {'; '.join(built)}")

    def unknown_options(self) -> None:
        assert self.cls is not None
        with self.check("unknown-options"):
            config = self.harness.moe_config()
            try:
                with self.harness.context():
                    self.cls(config, **{UNKNOWN_OPTION: 1})
            except Exception as exc:
                message = str(exc)
                if UNKNOWN_OPTION not in message:
                    raise _fail(f"rejected {UNKNOWN_OPTION}=1 with {describe_exception(exc)}, which does not "
                                "name the option; say which option is unknown (and which are accepted)") from exc
                self.passed(f"{type(exc).__name__}: {message.splitlines()[0] if message else ''}")
                return
            raise _fail(f"{self.cls.__name__}(moe_config, {UNKNOWN_OPTION}=1) was accepted; a misspelt rule option "
                        "would be silently ignored. Raise TypeError naming the unknown option(s)")

    def weights(self) -> None:
        from ..models.gpt_oss_moe import random_gpt_oss_mxfp4_experts
        from .harness import MoeShape

        with self.check("weights"):
            shape = MoeShape()
            notes: list[str] = []
            for bias, ep_rank, ep_size in ((True, 0, 1), (False, 0, 1), (True, 1, EP_SIZE)):
                label = ("with biases" if bias else "without biases") + (
                    f", EP rank {ep_rank} of {ep_size}" if ep_size > 1 else "")
                layer = self.harness.build(self.factory(), shape=shape, top_k=2, bias=bias, ep_size=ep_size,
                                           ep_rank=ep_rank)
                experts = random_gpt_oss_mxfp4_experts(shape.num_experts, shape.hidden, shape.intermediate,
                                                       bias=bias, seed=7)
                notes += _check_parameters(layer, layer.local_slice(experts), label)
            self.passed("w13_weight/_scale, w2_weight/_scale (uint8), w13_bias/w2_bias (float) registered and "
                        "written by vLLM's loader, with and without biases and on EP rank 1 of 2"
                        + (f"; padded beyond the loaded shape: {', '.join(dict.fromkeys(notes))}" if notes else ""))

    # -- numerical checks -------------------------------------------------------------------------
    def _case(self, experts: GptOssMxfp4Experts, tokens: int, top_k: int, seed: int,
              layer: MoeLayer | None = None) -> Case:
        from ..models.gpt_oss_moe import random_hidden_states, random_router_logits, route_topk_softmax
        from .diagnose import Case

        x = random_hidden_states(tokens, experts.hidden, seed=seed)
        logits = random_router_logits(tokens, experts.num_experts, seed=seed + 1)
        weights, ids = route_topk_softmax(logits, top_k)
        if layer is None or layer.ep_size == 1:
            return Case(experts, x, logits, ids, weights)
        return Case(experts, x, logits, ids, weights, layer.experts_min, layer.num_local_experts)

    def _compare(self, out: Any, case: Case) -> tuple[float, str | None]:
        """(relative error, problem or None) of one output against the reference."""
        import torch

        from ..models.gpt_oss_moe import relative_error
        from .diagnose import explain

        tokens, hidden = case.x.shape
        if tuple(out.shape) != (tokens, hidden):
            return math.inf, f"output shape {tuple(out.shape)}, expected ({tokens}, {hidden})"
        if out.dtype != case.x.dtype:
            return math.inf, (f"output dtype {out.dtype} for {case.x.dtype} input; vLLM's runner (and its "
                              "torch.compile fake) expect the input's dtype")
        bad = int((~torch.isfinite(out)).sum())
        if bad:
            return math.inf, f"{bad} of {out.numel()} outputs are not finite (NaN/inf)"
        ref = case.reference()
        err = relative_error(out, ref)
        if err > self.tolerance:
            return err, f"rel err {err:.3g} > {self.tolerance:g}. {explain(out, case, self.tolerance)}"
        return err, None

    def _numeric(self, runs: Iterable[tuple[str, Any]], total_label: str) -> None:
        """Turn ``(label, thunk -> (err, problem))`` runs into the check's outcome."""
        failures: list[tuple[str, float, str]] = []
        worst = (-1.0, "")
        count = 0
        for label, run in runs:
            count += 1
            try:
                err, problem = run()
            except _Outcome:
                raise
            except Exception as exc:
                failures.append((label, math.inf, f"raised {describe_exception(exc)}"))
                continue
            if problem is not None:
                failures.append((label, err, problem))
            elif err > worst[0]:
                worst = (err, label)
        if failures:
            failures.sort(key=lambda f: -f[1] if math.isfinite(f[1]) else -1e300)
            numeric = [f for f in failures if math.isfinite(f[1])]
            head_label, _, head_problem = numeric[0] if numeric else failures[0]
            head_problem = head_problem.rstrip(".") + "."
            if len({p for _, _, p in failures}) == 1 and len(failures) > 1:
                raise _fail(f"{len(failures)} of {count} runs fail, all with: {head_problem}")
            others = [lbl + (f" (err {e:.2g})" if math.isfinite(e) else "") for lbl, e, _ in failures
                      if lbl != head_label]
            more = f" Other failing runs: {'; '.join(others[:4])}{'; ...' if len(others) > 4 else ''}" if others else ""
            raise _fail(f"{len(failures)} of {count} runs fail; worst: {head_label}: {head_problem}{more}")
        self.passed(f"{count} runs ({total_label}); worst rel err {worst[0]:.1e} at {worst[1]}; "
                    f"tolerance {self.tolerance:g}")

    def _layer_runs(self, experts: GptOssMxfp4Experts, top_k: int, tokens: Sequence[int], seed: int,
                    ep_rank: int = 0, ep_size: int = 1) -> Iterator[tuple[str, Any]]:
        """Build and load one layer, then yield one run per token count (build errors fail them all)."""
        where = f"EP rank {ep_rank}, " if ep_size > 1 else ""
        try:
            layer = self.harness.ready(self.factory(), experts, top_k=top_k, ep_size=ep_size, ep_rank=ep_rank)
        except Exception as exc:
            problem = f"building/loading/process_weights_after_loading raised {describe_exception(exc)}"
            for t in tokens:
                yield f"{where}{_tokens(t)}, top-{top_k}", lambda p=problem: (math.inf, p)
            return
        for t in tokens:
            def run(t: int = t) -> tuple[float, str | None]:
                case = self._case(experts, t, top_k, seed + 10 * t, layer)
                return self._compare(layer.forward(case.x, case.router_logits), case)

            yield f"{where}{_tokens(t)}, top-{top_k}", run

    def forward(self, bias: bool) -> None:
        from ..models.gpt_oss_moe import random_gpt_oss_mxfp4_experts
        from .harness import MoeShape

        shape = MoeShape()
        with self.check("forward-bias" if bias else "forward-no-bias"):
            experts = random_gpt_oss_mxfp4_experts(shape.num_experts, shape.hidden, shape.intermediate, bias=bias,
                                                   seed=100 if bias else 200)
            runs = (run for k in TOP_KS for run in self._layer_runs(experts, k, TOKENS, seed=1000 * k))
            self._numeric(runs, f"tokens {', '.join(map(str, TOKENS))} x top-k {TOP_KS[0]}..{TOP_KS[-1]}")

    def expert_parallel(self) -> None:
        from ..models.gpt_oss_moe import random_gpt_oss_mxfp4_experts
        from .harness import MoeShape

        shape = MoeShape()
        with self.check("expert-parallel"):
            experts = random_gpt_oss_mxfp4_experts(shape.num_experts, shape.hidden, shape.intermediate, bias=True,
                                                   seed=300)
            runs = (run for rank in range(EP_SIZE) for k in EP_TOP_KS
                    for run in self._layer_runs(experts, k, EP_TOKENS, seed=3000 + 100 * k, ep_rank=rank,
                                                ep_size=EP_SIZE))
            self._numeric(runs, f"ranks 0 and 1 of {EP_SIZE} x tokens {', '.join(map(str, EP_TOKENS))} x "
                                f"top-k {', '.join(map(str, EP_TOP_KS))}, biases on")

    def deterministic(self) -> None:
        import torch

        from ..models.gpt_oss_moe import random_gpt_oss_mxfp4_experts
        from .harness import MoeShape

        shape = MoeShape()
        with self.check("deterministic"):
            experts = random_gpt_oss_mxfp4_experts(shape.num_experts, shape.hidden, shape.intermediate, bias=True,
                                                   seed=400)
            first = self.harness.ready(self.factory(), experts, top_k=2)
            case = self._case(experts, 64, 2, seed=4000)
            other = self._case(experts, 7, 2, seed=4100)
            a = first.forward(case.x.clone(), case.router_logits.clone())
            first.forward(other.x, other.router_logits)
            b = first.forward(case.x.clone(), case.router_logits.clone())
            if not torch.equal(a, b):
                raise _fail(f"two calls on the same layer with identical inputs differ (max |diff| "
                            f"{float((a.double() - b.double()).abs().max()):.3g}, another call in between); "
                            "look for state kept between calls or non-deterministic reductions")
            second = self.harness.ready(self.factory(), experts, top_k=2)
            c = second.forward(case.x.clone(), case.router_logits.clone())
            if not torch.equal(a, c):
                raise _fail(f"a second layer loaded with the same weights gives a different output (max |diff| "
                            f"{float((a.double() - c.double()).abs().max()):.3g}); look for state shared between "
                            "layers or depending on load order")
            self.passed("64 tokens, top-2, biases: same layer twice (another call in between) and a second "
                        "layer with the same weights give bit-identical outputs")


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def _check_parameters(layer: MoeLayer, local: GptOssMxfp4Experts, label: str) -> list[str]:
    """Fail unless the layer has the parameters the GPT-OSS loader writes and the writes succeed."""
    import torch

    params = layer.parameters()
    notes: list[str] = []
    n = layer.num_local_experts
    for name, tensor in local.tensors().items():
        param = params.get(name)
        if param is None:
            raise _fail(f"{label}: no parameter '{name}', which vLLM's GPT-OSS MXFP4 loader writes "
                        f"(create_weights registered: {', '.join(sorted(params)) or 'nothing'})")
        blocks = name.endswith(("_weight", "_weight_scale"))
        if blocks and param.dtype != torch.uint8:
            raise _fail(f"{label}: '{name}' is {param.dtype}; the loader copies uint8 MXFP4 "
                        f"{'scales' if name.endswith('scale') else 'blocks'} into it, and copy_ would convert "
                        "the bytes to numbers silently. Allocate uint8 and convert in process_weights_after_loading")
        if not blocks and not param.dtype.is_floating_point:
            raise _fail(f"{label}: '{name}' is {param.dtype}; biases are bf16 in the checkpoint")
        want = tuple(tensor.shape)
        have = tuple(param.shape)
        if len(have) != len(want) or have[0] != n or any(h < w for h, w in zip(have[1:], want[1:])):
            raise _fail(f"{label}: '{name}' has shape {list(have)}; the loader writes {list(want)} into "
                        f"param[:, :{want[1]}{', :' + str(want[2]) if len(want) > 2 else ''}] "
                        f"(first dim = the rank's {n} experts, the others at least the checkpoint's)")
        if have != want:
            notes.append(name)
        try:
            layer.load_parameter(name, tensor)
        except Exception as exc:
            raise _fail(f"{label}: vLLM's loader could not write '{name}' {list(want)} into {list(have)}: "
                        f"{describe_exception(exc)}") from exc
        if tuple(params[name].shape) != have or layer.parameters()[name] is not param:
            raise _fail(f"{label}: loading replaced or reshaped '{name}'")
    return notes


@contextlib.contextmanager
def _quiet_vllm() -> Iterator[None]:
    """stdout to stderr and ``VLLM_LOGGING_LEVEL=WARNING`` (unless set) while the checks run.

    The variable is put back afterwards: it is read when vLLM is first imported, and leaving it
    set would silence vLLM's INFO log in every subprocess this process starts later.
    """
    saved = os.environ.get("VLLM_LOGGING_LEVEL")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        with contextlib.redirect_stdout(sys.__stderr__ or sys.stderr):
            yield
    finally:
        if saved is None:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)
        else:
            os.environ["VLLM_LOGGING_LEVEL"] = saved


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread while the checks run (restored after).

    The layers are tiny, so threads buy nothing, and on a busy CI machine OpenMP's spinning
    workers made the same run 10-70x slower (measured: 17.6 s vs 0.24 s for forward-bias on two
    loaded cores). Only torch's own setting is touched (the checks import torch anyway).
    """
    try:
        torch = importlib.import_module("torch")
    except Exception:  # no torch: the checks that need it report that themselves
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def resolve_method(method: str | Method, registry: Registry | None) -> tuple[Method | None, Registry | None, str]:
    """The :class:`Method` to check, the registry its rules come from, and why not if it is missing."""
    if isinstance(method, Method):
        return method, registry, ""
    registry = registry if registry is not None else Registry.build()
    found = registry.methods.get(method)
    if found is not None:
        return found, registry, ""
    names = sorted(registry.methods)
    faults = [str(f) for f in registry.failures]
    why = (f"no method '{method}' is registered{did_you_mean(method, names)} (registered: {', '.join(names)})"
           + (f"; plugin faults: {'; '.join(faults)}" if faults else ""))
    return None, registry, why


def run_checks(
    method: str | Method,
    *,
    registry: Registry | None = None,
    device: str = "cpu",
    tolerance: float | None = None,
    option_sets: Sequence[Mapping[str, Any]] = (),
    only: Iterable[str] | None = None,
    harness: VllmMoeHarness | None = None,
) -> Report:
    """Run the conformance suite on a registered method (by name) or on a :class:`Method`.

    ``registry`` supplies the method and the rules whose options are tried (built from the
    environment when a name is given without one). ``tolerance`` overrides the class's
    ``quantreg_tolerance``; ``option_sets`` are tried in addition to the rules' options; ``only``
    restricts the run to some of :data:`CHECK_IDS`; ``harness`` reuses a
    :class:`~quantreg.testing.harness.VllmMoeHarness` (one is made and removed otherwise).
    """
    selected = set(CHECK_IDS if only is None else only)
    unknown = selected - set(CHECK_IDS)
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(sorted(unknown))}; checks are: {', '.join(CHECK_IDS)}")
    name = method if isinstance(method, str) else method.name
    found, registry, why = resolve_method(method, registry)
    report = Report(method=name, device=device)
    if found is None or found.name == VLLM_METHOD:
        status, rest = (Status.FAIL, "not registered") if found is None else (Status.SKIPPED, "nothing to check")
        why = why or f"'{VLLM_METHOD}' stands for vLLM's own method choice; there is no plugin class to check"
        report.availability = why
        report.results.append(CheckResult("registered", _SPECS["registered"].title, status, why))
        report.results += [CheckResult(c.id, c.title, Status.SKIPPED, rest, c.needs_device)
                           for c in CHECKS[1:] if c.id in selected]
        return report
    run = _Run(found, registry, device, tolerance, option_sets, selected, harness)
    run.record("registered", Status.PASS, f"by plugin '{found.plugin or '?'}' as {found.target}")
    try:
        with _one_thread():
            run.run()
    finally:
        run.close()
    report.target, report.plugin = found.target, found.plugin
    report.available, report.availability = run.availability.ok, run.availability.reason
    report.tolerance, report.quant_format = run.tolerance, run.quant_format
    report.results = [run.results[c] for c in CHECK_IDS if c in run.results]
    return report


def check_method_command(name: str, *, device: str | None = None, config: Sequence[str] = (),
                         as_json: bool = False) -> int:
    """``quantreg check-method``: run the suite, print the table (or JSON), 0 if nothing failed.

    vLLM logs to stdout; the run happens with stdout sent to the process's stderr so that stdout
    carries the table (or valid JSON) only, and vLLM's INFO chatter is off unless
    ``VLLM_LOGGING_LEVEL`` is set. vLLM's log handler keeps the stream it found at import, hence
    ``sys.__stderr__`` (never closed) rather than whatever ``sys.stderr`` is at the moment.
    """
    from ..environment import guess_device

    registry = Registry.build(config=config)
    for fault in [*registry.problems, *registry.failures]:
        print(f"warning: {fault}", file=sys.stderr)
    with _quiet_vllm():
        report = run_checks(name, registry=registry, device=device or guess_device())
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.render(width=min(140, max(80, shutil.get_terminal_size().columns))))
    return 0 if report.ok else 1
