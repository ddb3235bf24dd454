"""What a MoE method is to the registry: a name, a lazily imported class, and where it can run.

Nothing here imports the target or the probe until someone asks for availability or for the
class itself, so listing methods and resolving keys stays cheap inside every vLLM process.
This module is also the one home of what a valid method name and target look like (plugin
registrations, table-defined methods and :func:`load_object` all check with it) and of the
construction contract: how the seam calls a method class (:class:`BuildContext`).
"""

from __future__ import annotations

import importlib
import inspect
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeGuard

from . import settings
from .installed import installed_vllm_version, module_available
from .keys import EXPERTS, LAYER_KINDS, WILDCARD, Key
from .problems import printable
from .version_spec import check_specifier, satisfies

if TYPE_CHECKING:  # quantreg.host is read when a method's availability is asked, not at start-up
    from .host import HostFacts

Probe = Callable[[], "tuple[bool, str]"]

VLLM_METHOD = "vllm"

# A method name (and every name in a table): what ``quantreg list`` can print and a rule can name.
NAME_RE = r"^[A-Za-z0-9_.\-]+$"
# ``package.module:Class`` (or ``:attr.path``): dotted identifiers on both sides of one colon.
TARGET_RE = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
_NAME_MATCH = re.compile(NAME_RE).fullmatch  # compiled once: a 10,000-rule table checks ~40,000 names
_TARGET_MATCH = re.compile(TARGET_RE).fullmatch


def valid_name(name: object) -> TypeGuard[str]:
    """Is ``name`` a string of letters, digits, ``_``, ``.`` and ``-`` (the NAME pattern)?"""
    return isinstance(name, str) and _NAME_MATCH(name) is not None


def valid_target(target: object) -> TypeGuard[str]:
    """Is ``target`` of the form ``package.module:Class`` (the TARGET pattern)?"""
    return isinstance(target, str) and _TARGET_MATCH(target) is not None


def keeps_vllm(name: str) -> bool:
    """Is ``name`` the built-in ``vllm`` method, which stands for "let vLLM build its own"?

    It has no class to build, ignores options and cannot be redefined; every such special case
    asks here (or :attr:`Method.keeps_vllm`). It is available unless a
    :class:`~quantreg.vllm_limits.VllmLimitation` holds for the key on this host: that depends on
    the key, so :meth:`quantreg.registry.Registry.availability_for` decides it, not
    :meth:`Method.availability`.
    """
    return name == VLLM_METHOD


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str


#: How a method may hold the expert weights (:attr:`Method.expert_layout`): ``checkpoint``: as
#: stored (vLLM's own method keeps MXFP4 packed, bf16 as bf16); ``packed``: MXFP4 codes + one
#: E8M0 scale byte per 32 values; ``bf16``: dequantised to bf16.
EXPERT_LAYOUTS = ("checkpoint", "packed", "bf16")


@dataclass(frozen=True)
class Method:
    """A registered MoE method.

    ``target`` is ``"package.module:Class"``; ``probe`` is a callable or such a string naming
    one, returning ``(ok, reason)``. ``requires`` lists importable modules checked with
    ``find_spec`` (no import). ``vllm_version`` is a specifier such as ``">=0.30,<0.40"``.
    ``options`` names the options a rule may pass (``None``: the method accepts any).
    ``option_values`` says, for an option whose values are a fixed set, which values the method
    accepts (``{"layout": ("rows", "tiles")}``): ``quantreg validate`` refuses a rule giving
    another value (FILE:LINE and key), and the seam refuses to build the method with one
    (:meth:`refused_option`), so a refusal is the registration's, not each constructor's.
    ``expert_layout`` says how the method holds the expert weights, for ``quantreg plan``'s
    memory estimate: one of :data:`EXPERT_LAYOUTS` (``None``: not declared, bytes unknown).
    ``host`` lists what the method needs of the host, as ``"cpu:FLAG"`` entries (a
    ``/proc/cpuinfo`` flag such as ``"cpu:avx2"``, ``"cpu:fma"``, ``"cpu:amx_tile"``), every entry
    required; one entry may name alternatives, ``"cpu:avx512_vnni|avx_vnni"`` (either flag meets
    it: an int8 kernel that needs VNNI in its EVEX or its VEX form). Decided from
    :func:`quantreg.host.host_facts` before the probe runs, so a kernel that needs AVX2 is passed
    over on a CPU without it by a declaration rather than by running plugin code.
    """

    name: str
    target: str
    devices: tuple[str, ...] = (WILDCARD,)
    requires: tuple[str, ...] = ()
    vllm_version: str | None = None
    probe: Probe | str | None = None
    description: str = ""
    options: tuple[str, ...] | None = None
    expert_layout: str | None = None
    host: tuple[str, ...] = ()
    option_values: Mapping[str, tuple[Any, ...]] | None = field(default=None, compare=False)
    """Per option, the values the method accepts (options not named take any value). Not compared
    (a mapping is not hashable): two registrations differing only here are one method."""
    plugin: str = field(default="", compare=False)
    layers: tuple[str, ...] = (EXPERTS,)
    """The layer kinds the method can decide (:data:`quantreg.keys.LAYER_KINDS`): a MoE method
    (``experts``, the default) subclasses vLLM's ``FusedMoEMethodBase``; a method for
    ``attention`` / ``dense`` / ``lm_head`` layers subclasses vLLM's ``QuantizeMethodBase`` and is
    built as ``cls(vllm_method, **options)`` with the method vLLM chose for the layer. A chain
    passes over a method for a key of another kind (docs/dense.md)."""
    numerics: str = ""
    """What the method rounds, and per what block (one line, free text), e.g. "weights int8 per
    (row, 32-block along K), activations int8 per (token, 32-block)". Printed by ``quantreg explain``
    and ``quantreg check-method`` beside the method, so an operator sees the price of a fast method
    next to its name (issue 54); empty: not declared."""

    @property
    def keeps_vllm(self) -> bool:
        """The built-in ``vllm`` method (see :func:`keeps_vllm`)."""
        return keeps_vllm(self.name)

    def runs_on(self, device: str) -> bool:
        return WILDCARD in self.devices or device in self.devices

    def availability(self, device: str) -> Availability:
        """Is this method usable for ``device`` in this process? Never raises."""
        if self.keeps_vllm:
            return Availability(True, "vLLM's own method")
        if not self.runs_on(device):
            return Availability(False, f"runs on {', '.join(self.devices)}, not {device}")
        if self.host:
            from .host import host_facts

            missing = host_shortfall(self.host, host_facts())
            if missing is not None:
                return Availability(False, missing)
        for module in self.requires:
            if not module_available(module):
                return Availability(False, f"requires module '{module}', which is not installed")
        if self.vllm_version:
            installed = installed_vllm_version()
            if installed is None:
                return Availability(False, f"requires vLLM {self.vllm_version}; vLLM is not installed")
            if not version_satisfies(installed, self.vllm_version):
                return Availability(False, f"requires vLLM {self.vllm_version}; installed is {installed}")
        if self.probe is None:
            return Availability(True, "no probe; device and requirements satisfied")
        return run_probe(self.probe, float(settings.value(settings.PROBE_TIMEOUT)))

    def load(self, *, base: type[Any] | None = None) -> type[Any]:
        """Import the target; it must be a class, and a subclass of ``base`` when one is given.

        ``base`` is vLLM's class the layer's method extends (``FusedMoEMethodBase`` for the experts,
        ``QuantizeMethodBase`` for the other layer kinds), passed by the caller that builds for vLLM
        (the seams, ``verify:``, the kit, ``tune``) from :mod:`quantreg.vllm.platform`: the core
        imports nothing of vLLM, so it cannot look the class up itself. ``None``: no class check
        (no vLLM in this process, or a caller that only reads the class).
        """
        obj = load_object(self.target)
        if not isinstance(obj, type):
            raise TypeError(f"method '{self.name}' target {self.target} is a {type(obj).__name__}, not a class")
        if base is not None and not issubclass(obj, base):
            raise TypeError(
                f"method '{self.name}' target {self.target} does not subclass vLLM's {base.__name__}"
            )
        return obj

    def refused_option(self, options: Mapping[str, Any]) -> str | None:
        """Why this method cannot take ``options`` by its declared :attr:`option_values`, or ``None``."""
        for name, accepted in (self.option_values or {}).items():
            if name in options and not any(_same_value(options[name], a) for a in accepted):
                return (f"method '{self.name}' does not accept option {name}={_shown(options[name])} "
                        f"(accepted: {', '.join(map(_shown, accepted))})")
        return None

    def build(self, moe_config: Any, context: BuildContext, *, base: type[Any] | None = None) -> Any:
        """Load the target (checked against ``base``, see :meth:`load`) and construct it the
        documented way (see :func:`construct`); what construction returns must be an instance of it.

        For a dense layer kind ``moe_config`` is the method vLLM chose for the layer. Why the
        instance check: a class whose ``__new__`` returns ``None``, ``42`` or another method's object
        would otherwise be handed to vLLM (or taken for "no method") while the decision line, the
        trail and ``explain`` name this method; it is this method's fault, raised here as a ``TypeError``.
        """
        refused = self.refused_option(context.options)
        if refused is not None:
            raise ValueError(refused)
        cls = self.load(base=base)
        built = construct(cls, moe_config, context)
        if not isinstance(built, cls):
            raise TypeError(f"method '{self.name}' (plugin '{self.plugin or 'quantreg'}'): constructing {self.target} "
                            f"returned {_shown_object(built)}, not an instance of {cls.__name__}")
        return built


def check_method(method: Any) -> str | None:
    """What is wrong with something a plugin passed to ``register()``, or ``None``.

    The one validation point for plugin registrations: every field is type-checked here, so a
    ``Method(name=None)``, ``devices="hpu"`` (a string would match device ``pu`` by substring) or
    a target of the wrong shape is a fault at load time instead of a crash in every command.
    """
    if not isinstance(method, Method):
        return f"register() expects a quantreg.Method, got {type(method).__name__}"
    if not valid_name(method.name):
        return f"method name {_shown(method.name)} is not valid (letters, digits, '_', '.', '-')"
    name = method.name
    if not valid_target(method.target):
        return f"method '{name}': target {_shown(method.target)} is not of the form 'package.module:Class'"
    bad = (_names_problem(method.devices, "devices", "device names", ("hpu",), WILDCARD)
           or _names_problem(method.requires, "requires", "module names", ("my_runtime",), None, _MODULE_MATCH)
           or (None if method.options is None
               else _names_problem(method.options, "options", "option names", ("chunk",), None)))
    if bad:
        return f"method '{name}': {bad}"
    bad = host_requirements_problem(method.host) or option_values_problem(method.option_values, method.options)
    if bad:
        return f"method '{name}': {bad}"
    if (not isinstance(method.layers, tuple) or not method.layers
            or any(not isinstance(k, str) or k not in LAYER_KINDS for k in method.layers)):
        return (f"method '{name}': layers must be a non-empty tuple of {', '.join(LAYER_KINDS)}, "
                f"got {_shown(method.layers)}")
    if method.vllm_version is not None:
        if not isinstance(method.vllm_version, str):
            return f"method '{name}': vllm_version must be a string such as '>=0.30,<0.40' or None, " \
                   f"got {type(method.vllm_version).__name__}"
        bad = check_specifier(method.vllm_version) if method.vllm_version else None
        if bad:
            return f"method '{name}': vllm_version {bad}"
    probe = method.probe
    if probe is not None and not callable(probe) and not valid_target(probe):
        return (f"method '{name}': probe must be a callable or 'package.module:function', "
                f"got {_shown(probe)}")
    if not isinstance(method.description, str):
        return f"method '{name}': description must be a string, got {type(method.description).__name__}"
    if not isinstance(method.numerics, str):
        return f"method '{name}': numerics must be a string, got {type(method.numerics).__name__}"
    if method.expert_layout is not None and method.expert_layout not in EXPERT_LAYOUTS:
        return (f"method '{name}': expert_layout must be one of {', '.join(EXPERT_LAYOUTS)} or None, "
                f"got {_shown(method.expert_layout)}")
    return None


def option_values_problem(value: Any, options: tuple[str, ...] | None) -> str | None:
    """``None`` if ``value`` is ``None`` or a mapping of declared option names to non-empty tuples
    (or lists) of plain values (str, int, float, bool, None), else what is wrong."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        return f"option_values must be a mapping such as {{'layout': ('rows', 'tiles')}}, got {_shown(value)}"
    for name, accepted in value.items():
        if not valid_name(name) or (options is not None and name not in options):
            return f"option_values names {_shown(name)}, which is not one of its options"
        if (isinstance(accepted, str) or not isinstance(accepted, (tuple, list)) or not accepted
                or any(not isinstance(v, (str, int, float, bool, type(None))) for v in accepted)):
            return (f"option_values[{name!r}] must be a non-empty tuple of plain values (str, int, float, bool), "
                    f"got {_shown(accepted)}")
    return None


def _same_value(given: Any, accepted: Any) -> bool:
    """``given`` equals ``accepted`` as YAML reads it: ``True`` is not ``1``, ``1`` is ``1.0``."""
    return isinstance(given, bool) == isinstance(accepted, bool) and given == accepted


def _shown_object(value: Any) -> str:
    """What a constructor returned, for a message: ``None``, ``int 42``, ``another class Name``."""
    if value is None:
        return "None"
    return f"{type(value).__module__}.{type(value).__qualname__} object" if not isinstance(
        value, (int, float, str, bytes)) else f"{type(value).__name__} {_shown(value)}"


# -- what a method needs of the host ----------------------------------------------------------
HOST_KINDS = ("cpu",)
_FLAG_MATCH = re.compile(r"[a-z0-9_]+(\|[a-z0-9_]+)*").fullmatch
"""One flag, or alternatives ``a|b`` (either meets the requirement)."""


def host_requirements_problem(value: Any) -> str | None:
    """``None`` if ``value`` is a tuple/list of ``"cpu:FLAG"`` (or ``"cpu:FLAG|FLAG"``) strings, else what is wrong."""
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        return f"host must be a tuple of requirements such as ('cpu:avx2', 'cpu:fma'), got " \
               f"{type(value).__name__} {_shown(value)}"
    for item in value:
        kind, sep, flag = item.partition(":") if isinstance(item, str) else ("", "", "")
        if not sep or kind not in HOST_KINDS or not _FLAG_MATCH(flag):
            return (f"host holds {_shown(item)}, which is not a requirement of the form 'cpu:FLAG' "
                    "(a lower-case /proc/cpuinfo flag such as 'cpu:avx2', or alternatives such as "
                    "'cpu:avx512_vnni|avx_vnni')")
    return None


def host_shortfall(requirements: tuple[str, ...], facts: HostFacts) -> str | None:
    """Why ``facts`` do not meet ``requirements`` (``"cpu:FLAG"`` entries, ``"cpu:A|B"`` met by
    either flag), or ``None`` if they do. An unmet alternative reads ``A or B``."""
    wanted = [r.partition(":")[2].split("|") for r in requirements if r.startswith("cpu:")]
    unmet = [alts for alts in wanted if not any(f in facts.cpu_flags for f in alts)]
    if not unmet:
        return None
    missing = [" or ".join(alts) for alts in unmet]
    if not facts.is_x86 and any(f.startswith(("avx", "amx", "fma")) for alts in unmet for f in alts):
        have = f"{_article(facts.machine)} {facts.machine} CPU"
    else:
        shown = facts.notable_flags
        have = f"{_article(facts.kind)} {facts.kind} CPU (flags: {', '.join(shown) if shown else 'none of note'})"

    simulated = f"; flags simulated by {settings.HOST_CPU_FLAGS}" if facts.simulated else ""
    plural = "s" if len(missing) > 1 else ""
    return f"needs cpu flag{plural} {', '.join(missing)}, this host has {have}{simulated}"


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeio" else "a"


_MODULE_MATCH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*").fullmatch


def _names_problem(value: Any, field_name: str, what: str, example: tuple[str, ...], also: str | None,
                   match: Callable[[str], Any] | None = None) -> str | None:
    """``None`` if ``value`` is a tuple or list of valid names (or ``also``), else what is wrong."""
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        return (f"{field_name} must be a tuple of {what} such as {example!r}, got {type(value).__name__} "
                f"{_shown(value)}")
    for item in value:
        ok = isinstance(item, str) and (item == also or (match(item) is not None if match else valid_name(item)))
        if not ok:
            return f"{field_name} holds {_shown(item)}, which is not one of the {what}"
    return None


def _shown(value: Any) -> str:
    """``repr`` of a registered value for a message, bounded (a plugin may pass anything)."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


# -- the construction contract ----------------------------------------------------------------
CONTEXT_KEYWORD = "quantreg_context"


@dataclass(frozen=True)
class BuildContext:
    """What the seam knows when it builds a method for one layer, handed to classes that ask.

    ``key`` is the layer's (quant_format, model_type, device) as the registry resolved it, so a
    method need not re-read vLLM's global config; ``rule`` is the winning rule's ``file:line``;
    ``options`` are that rule's options (also passed as keywords); ``prefix`` and ``layer`` are
    what vLLM passed to ``_get_quant_method`` (the layer is still being constructed).
    """

    key: Key
    method: str
    rule: str
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    prefix: str = ""
    layer: Any = field(default=None, compare=False, repr=False)


def wants_context(cls: type[Any]) -> bool:
    """Does ``cls`` name a ``quantreg_context`` parameter (not merely ``**kwargs``)?

    Opting in by name keeps plain ``cls(moe_config, **options)`` classes working unchanged: a
    catch-all ``**options`` never receives the context, so it cannot be mistaken for an option.
    """
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # no introspectable signature: build it the plain way
        return False
    param = params.get(CONTEXT_KEYWORD)
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


def construct(cls: type[Any], moe_config: Any, context: BuildContext) -> Any:
    """``cls(moe_config, **options)``, plus ``quantreg_context=context`` if the class asks for it."""
    options = dict(context.options)
    if wants_context(cls):
        return cls(moe_config, **options, **{CONTEXT_KEYWORD: context})
    return cls(moe_config, **options)


def run_probe(probe: Probe | str, timeout: float) -> Availability:
    """Run a third-party probe through the one caller of plugin code (:func:`quantreg.hookcall.call`).

    It may raise anything (``SystemExit`` included) or hang; resolution may not. A probe still
    running after ``timeout`` seconds is abandoned in its daemon thread (Python cannot kill a
    thread) and the method is reported unavailable, so one stuck device query cannot hold
    vLLM's start-up. What it prints goes to stderr (stdout may be a --json answer).
    """
    from .hookcall import TIMED_OUT, call

    def probe_call() -> Availability:
        fn = load_object(probe) if isinstance(probe, str) else probe
        ok, reason = fn()
        # a probe's reason is outside text (plugin #2 quotes its build-failure file): escaped once, here,
        # so list, explain, doctor and vLLM's log all show one line
        return Availability(bool(ok), printable(str(reason)))

    shown = probe if isinstance(probe, str) else getattr(probe, "__qualname__", "probe")
    result, error = call(f"running probe {shown!r}", probe_call, timeout=min(max(timeout, 0.0), threading.TIMEOUT_MAX))
    if error is None and isinstance(result, Availability):
        return result
    if error is not None and error.startswith(TIMED_OUT):
        return Availability(False, f"probe did not answer within {timeout:g}s ({settings.PROBE_TIMEOUT})")
    return Availability(False, f"probe raised {error}")


def load_object(target: str) -> Any:
    """Import ``"package.module:attr.path"``; errors name the target."""
    if not valid_target(target):
        raise ValueError(f"target {target!r} is not of the form 'package.module:Name'")
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"module '{module_name}' has no attribute '{attr}' (target {target})") from None
    return obj


def version_satisfies(version: str, spec: str) -> bool:
    """Does the installed ``version`` meet a method's ``vllm_version``? (:func:`quantreg.version_spec.satisfies`;
    a clause that cannot be read is not met.)"""
    try:
        return satisfies(version, spec)
    except ValueError:
        return False
