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
* **first-forward** -- a method that builds (constructor, ``create_weights``, loading) survives its
  first forward: quantreg's seam contains a failure while a method is built, not one at its first
  forward (a native library that does not load must be refused by the constructor);
* **forward-bias / forward-no-bias** -- after ``process_weights_after_loading``, outputs for 1, 7
  and 64 tokens and top-k 1..4 have the input's shape and dtype, are finite, and are within the
  declared tolerance of the float64 reference (:mod:`quantreg.models.gpt_oss_moe`);
* **heavy-tailed** -- on inputs with massive-activation channels (a few channels at 10x and 100x
  the rest on some tokens) the output's rms error against float64 is at most 1.10x that of a Q8_0
  emulation (exact MXFP4 weights, activations int8 per 32 with fp16 scales, as llama.cpp's
  ``vec_dot_mxfp4_q8_0``), for every option set its rules pass (:mod:`.heavy_tail`);
* **expert-parallel** -- ranks 0 and 1 of 2 each give the partial sum of their own experts;
* **deterministic** -- identical inputs give bit-identical outputs, on the same layer (with
  other calls in between) and on a second layer loaded with the same weights;
* **compiled** -- the forward vLLM's runner calls traces under ``torch.compile(fullgraph=True)``
  with a dynamic token count and equals eager (vLLM's default mode; :mod:`.compiled`).

The checks from ``first-forward`` on need the method to run here: when ``Method.availability(device)`` says no they
are SKIPPED with its reason, never passed; everything else is checked anyway (construction,
``create_weights`` and loading do not touch the device's kernels). A method declares its
weight format and tolerance as class attributes ``quantreg_format`` (default and, so far, only
``"gpt_oss_mxfp4"``) and ``quantreg_tolerance`` (default 0.02, :mod:`quantreg.error_measure`, measured as
``max |out - ref| / max |ref|``).

:data:`CHECKS` is the one list of the suite: each check's id, title, what it needs, and the
function that checks it (in :mod:`~quantreg.testing.declared`, :mod:`~quantreg.testing.forward`
and :mod:`~quantreg.testing.consistency`); the order is the order of the report. Everything
else -- :data:`CHECK_IDS`, the pytest items, which checks import the class, which are skipped
without a device -- is derived from it. This module imports neither torch nor vLLM.
"""

from __future__ import annotations

from . import compiled, consistency, declared, forward, heavy_tail
from .context import CheckSpec, Context, Need
from .report import Status

PROBE_BUDGET_S = 5.0
"""How long the ``probe`` check waits for an answer (read when a run starts)."""

CHECKS: tuple[CheckSpec, ...] = (
    CheckSpec("registered", "registered with quantreg", Need.NOTHING, declared.registered),
    CheckSpec("subclass", "subclasses vLLM's FusedMoEMethodBase", Need.VLLM, declared.subclass,
              provides=Need.CLASS),
    CheckSpec("declarations", "declares devices, requirements and options", Need.NOTHING, declared.declarations),
    CheckSpec("probe", "availability probe answers quickly and never raises", Need.NOTHING, declared.probe),
    CheckSpec("options", "builds with the options its rules pass", Need.CLASS, declared.options),
    CheckSpec("unknown-options", "rejects unknown options with a clear message", Need.CLASS,
              declared.unknown_options),
    CheckSpec("weights", "create_weights makes what vLLM's GPT-OSS MXFP4 loader writes", Need.FORMAT,
              forward.weights),
    CheckSpec("first-forward", "a build that succeeds survives its first forward", Need.DEVICE,
              forward.first_forward),
    CheckSpec("forward-bias", "matches the float64 reference, with biases", Need.DEVICE, forward.forward_bias),
    CheckSpec("forward-no-bias", "matches the float64 reference, without biases", Need.DEVICE,
              forward.forward_no_bias),
    CheckSpec("heavy-tailed", "as fine as llama.cpp's Q8_0 on heavy-tailed activations", Need.DEVICE,
              heavy_tail.moe_heavy_tailed),
    CheckSpec("expert-parallel", "EP ranks 0 and 1 of 2 give their partial sums", Need.DEVICE,
              consistency.expert_parallel),
    CheckSpec("deterministic", "identical inputs give bit-identical outputs", Need.DEVICE,
              consistency.deterministic),
    CheckSpec("compiled", "runs inside torch.compile(fullgraph=True) as in eager", Need.DEVICE,
              compiled.compiled),
)
CHECK_IDS: tuple[str, ...] = tuple(c.id for c in CHECKS)


def run_suite(ctx: Context) -> None:
    """Run the wanted checks in order: each runs when its needs are met, else is SKIPPED saying
    why. A check that provides a need (``subclass`` provides the class) also runs, unreported,
    when a wanted check needs it; nothing needing vLLM runs (or imports it) unless wanted."""
    deepest = max((c.needs for c in CHECKS if c.id in ctx.only), default=Need.NOTHING)
    for spec in CHECKS:
        if spec.id not in ctx.only and (spec.provides is None or spec.provides > deepest):
            continue
        why = ctx.unmet(spec.needs)
        if why is not None:
            ctx.record(spec, Status.SKIPPED, why)
            continue
        if ctx.progress is not None:  # a line per check in front of a user (check-method, not --json)
            ctx.progress(spec.id)
        with ctx.check(spec):
            spec.function(ctx)
