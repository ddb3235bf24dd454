"""The load loop: plugin registrations and table files → methods, tables, headers and problems.

Everything a :class:`~quantreg.registry.Registry` is built from is gathered here, as values:
nothing raises, every fault is a located :class:`Problem` or a :class:`PluginFailure`, and a
file with any problem is left out whole (nothing half-applied). Headers are kept for every file
whose YAML is a mapping, so the mode can honour ``strict: true`` in a file that was left out.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import builtin, settings
from .hookcall import remade
from .index import Index, ambiguity_problems
from .keys import EXPERTS
from .methods import Method, check_method, keeps_vllm
from .mode import strict_problem
from .plugins import PluginFailure, Plugins
from .problems import Problem, describe, did_you_mean, name_list, printable
from .table.file import TableFile, TableHeader, Tier, file_identity, read_table

if TYPE_CHECKING:  # read when a tool asks for findings or limitations, not in every vLLM start-up
    from .findings import Finding, Resolve
    from .vllm_limits import VllmLimitation



@dataclass(frozen=True)
class Loaded:
    """What one load produced: kept tables, every readable header, and what went wrong."""

    methods: dict[str, Method]
    tables: tuple[TableFile, ...]
    headers: tuple[TableHeader, ...]
    problems: tuple[Problem, ...]


def config_paths(env: Mapping[str, str]) -> tuple[str, ...]:
    """User table paths from ``QUANTREG_CONFIG`` (``os.pathsep``-separated, empty parts ignored)."""
    return tuple(settings.value(settings.CONFIG, env))


def load(
    plugins: Plugins,
    env: Mapping[str, str],
    config: Sequence[str | os.PathLike[str]] = (),
    default_table: str | os.PathLike[str] | None = None,
) -> Loaded:
    """Methods from the plugins, then the default, plugin, user (env) and run (``config``) tables."""
    methods = collect_methods(plugins.call_each("register_methods"), plugins.failures)
    defaults: list[tuple[str, Tier]] = []  # the built-in plugin's table: the default tier, read first
    paths: list[tuple[str, Tier]] = []
    for plugin, path in plugins.call_each("register_tables"):
        problem = f"register() expects a path, got {type(path).__name__}"
        if plugin == builtin.NAME:  # the caller may swap the shipped default table (tests, bench)
            defaults.append((os.fspath(default_table or path), Tier.DEFAULT))
            continue
        if isinstance(path, (str, os.PathLike)):
            try:
                fspath = os.fspath(path)
                if isinstance(fspath, str):
                    paths.append((str.__str__(fspath), Tier.PLUGIN))
                    continue
                problem = f"register() expects a str path, got {type(fspath).__name__}"
            except Exception as exc:  # a PathLike whose __fspath__ raises is this plugin's fault
                problem = f"the registered path cannot be read: {describe(exc)}"
        plugins.failures.append(PluginFailure(plugin, "register_tables", problem))
    paths = [*defaults, *paths, *((p, Tier.USER) for p in config_paths(env))]
    paths += [(os.fspath(p), Tier.RUN) for p in config]
    tables, headers, problems = load_tables(paths, methods)
    for table in tables:
        methods.update({m.name: m for m in table.methods})
    strict = strict_problem(env)
    problems = [*([strict] if strict else []), *setting_problems(env), *problems]
    return Loaded(methods, tuple(tables), tuple(headers), tuple(problems))


def collect_methods(registered: Iterable[tuple[str, Any]], failures: list[PluginFailure]) -> dict[str, Method]:
    """Plugin registrations → methods by name; the first registration of a name wins.

    Each registration is checked on its own (:func:`check_method`, the one validation point):
    a bad one is a fault naming plugin and hook and is dropped alone, the plugin's good ones stay.
    Sequences are stored as tuples, so a registered ``Method`` is a plain, hashable value.
    """
    methods: dict[str, Method] = {}
    for plugin, method in registered:
        try:
            problem = check_method(method)
            if problem is None and method.name in methods:
                problem = (f"method '{method.name}' is already registered by plugin "
                           f"'{methods[method.name].plugin}'; the first one is kept")
            if problem is None:
                kept = _plain_method(method, plugin)
        except Exception as exc:  # a Method subclass whose attributes raise is that plugin's fault too
            problem = f"registered a method that cannot be read: {describe(exc)}"
        if problem:
            failures.append(PluginFailure(plugin, "register_methods", problem))
            continue
        methods[kept.name] = kept
    return methods


def _plain_method(method: Method, plugin: str) -> Method:
    """A copy of a checked registration, made from every field of :class:`Method`, of exact ``str``
    and ``tuple`` values, owned by ``plugin``.

    Why: a plugin may pass ``str`` subclasses (whose ``__eq__``/``__lt__`` could raise later,
    in sorting or fingerprinting inside vLLM) or lists; ``str.__str__`` copies the text
    without calling any override. Every field is copied (:func:`~quantreg.hookcall.remade`).
    """
    def plain(value: Any) -> Any:
        if isinstance(value, str):
            return str.__str__(value)
        if isinstance(value, (list, tuple)):
            return tuple(plain(v) for v in value)
        if isinstance(value, Mapping):  # option_values: a dict of this process's own, values as tuples
            return {plain(k): plain(v) for k, v in value.items()}
        return value

    return remade(Method, method, plain, plugin=plugin)


def load_tables(
    paths: Sequence[tuple[str, Tier]], methods: Mapping[str, Method]
) -> tuple[list[TableFile], list[TableHeader], list[Problem]]:
    """Read every table, check method names and options, then drop whole files involved in ties.

    Methods defined in user tables count only while their table is valid, so dropping one
    table can invalidate another that used its methods: repeat until nothing changes.
    """
    parsed: list[TableFile] = []
    headers: list[TableHeader] = []
    problems: list[Problem] = []
    seen: set[tuple[object, Tier]] = set()
    for path, tier in paths:
        # One file reached by two paths (listed twice, a symlink, a hard link, a bind mount) is one
        # table, not a tie with itself; a path that cannot be stat'ed is read and reported on its own.
        ident: tuple[object, Tier] = (file_identity(path) or path, tier)
        if ident in seen:
            continue
        seen.add(ident)
        table, found, header = read_table(path, tier)
        problems += found
        if header is not None:
            headers.append(header)
        if table is not None:
            parsed.append(table)
    tables = parsed
    while True:
        known = dict(methods)
        for table in tables:
            for m in table.methods:
                if m.name in known:
                    problems.append(Problem(table.path, table.method_lines.get(m.name), f"methods.{m.name}",
                                            f"method '{m.name}' is already registered by '{known[m.name].plugin}'"))
                else:
                    known[m.name] = m
        bad = {t.path for t in tables if any(p.path == t.path for p in problems)}
        for table in tables:
            found = method_problems(table, known) + verify_problems(table, known)
            problems += found
            if found:
                bad.add(table.path)
        if not bad:
            break
        tables = [t for t in tables if t.path not in bad]
    # Reports are capped per pass (MAX_AMBIGUITIES), so look again until the kept files are free of ties.
    while pairs := Index(r for t in tables for r in t.rules).ambiguous_pairs():
        problems += ambiguity_problems(pairs)
        bad = {r.path for pair in pairs for r in pair}
        tables = [t for t in tables if t.path not in bad]
    problems += reference_problems(headers, {t.path for t in parsed}, known)
    return tables, headers, by_line(problems)


def reference_problems(headers: Sequence[TableHeader], valid: set[str], known: Mapping[str, Method]
                       ) -> list[Problem]:
    """The name and reference checks for files left out for other problems (their readable rules),
    so a file's every problem is reported in one pass; its own ``methods:`` count as known."""
    problems: list[Problem] = []
    for header in headers:
        if header.path in valid or not header.references:
            continue
        own = {name: Method(name=name, target="", plugin=f"table {header.path}") for name in header.own_methods}
        table = TableFile(header.path, header.tier, header.references)
        problems += method_problems(table, {**known, **own}) + verify_problems(table, {**known, **own})
    return problems


def setting_problems(env: Mapping[str, str]) -> list[Problem]:
    """Problems with the ``QUANTREG_*`` settings (:func:`quantreg.settings.problems`), one per variable.

    ``QUANTREG_STRICT`` is left to :mod:`quantreg.mode` (it reports it with the mode).
    """
    return [Problem(settings.ENVIRONMENT, None, name, message) for name, message in settings.problems(env)
            if name != settings.STRICT]


def by_line(problems: Sequence[Problem]) -> list[Problem]:
    """Problems grouped by file (in the order files first appear), each file's sorted by line."""
    order: dict[str, int] = {}
    for problem in problems:
        order.setdefault(problem.path, len(order))
    return sorted(problems, key=lambda p: (order[p.path], p.line if p.line is not None else 0))


def method_problems(table: TableFile, methods: Mapping[str, Method]) -> list[Problem]:
    """Methods a rule names must be registered, and its options accepted by each of them.

    Options go to whichever method of the chain is chosen, so every method that declares its
    options must accept all of them (``vllm`` takes none and ignores them).
    """
    problems = []
    for i, rule in enumerate(table.rules):
        for j, name in enumerate(rule.methods):
            line = rule.method_lines[j] if j < len(rule.method_lines) else rule.line
            method = methods.get(name)
            if method is None:
                problems.append(Problem(
                    table.path, line, f"rules[{i}].method",
                    f"unknown method '{name}'{did_you_mean(name, sorted(methods))} "
                    f"(registered: {name_list(sorted(methods))})"))
                continue
            if method.options is None or method.keeps_vllm:
                continue
            for option in rule.options:
                if option not in method.options:
                    accepted = ", ".join(method.options) or "none"
                    problems.append(Problem(
                        table.path, rule.options_line or rule.line, f"rules[{i}].options.{option}",
                        f"method '{name}' does not accept option '{option}'"
                        f"{did_you_mean(option, method.options)} (accepted: {accepted})"))
    return problems


def option_value_problems(table: TableFile, methods: Mapping[str, Method]) -> list[Problem]:
    """A rule's option values each method of its chain declares it cannot take (:attr:`Method.option_values`).

    Why ``validate`` alone reads these, not the load loop: a start-up that left the whole file out for
    them would also drop the file's other rules; there the method is refused at construction
    instead and the layer continues down the chain (:mod:`quantreg.vllm.route`), with one WARNING
    lenient and one line strict, the same refusal this check gives before any start-up.
    """
    problems = []
    for i, rule in enumerate(table.rules):
        for name in rule.methods:
            method = methods.get(name)
            if method is None or method.keeps_vllm:
                continue
            for option, value in rule.options.items():
                refused = method.refused_option({option: value})
                if refused is not None:
                    problems.append(Problem(table.path, rule.options_line or rule.line,
                                            f"rules[{i}].options.{option}", refused))
    return problems


def verify_problems(table: TableFile, methods: Mapping[str, Method]) -> list[Problem]:
    """A rule's ``verify:`` must be able to run: ``against`` a registered method (or ``float64``,
    checked in the table) that runs on the rule's devices, beside a chosen method that is not
    ``vllm`` (vLLM's own method is never wrapped, so its verification could never happen)."""
    problems = []
    for i, rule in enumerate(table.rules):
        spec = rule.verify
        if spec is None:
            continue
        from .table.verify import FLOAT64  # a rule has verify:, so the module is loaded already

        where = (table.path, rule.verify_line or rule.line, f"rules[{i}].verify")
        if rule.methods and all(keeps_vllm(m) for m in rule.methods):
            problems.append(Problem(*where, "can never run: the rule's method is 'vllm' (vLLM's own method is not "
                                            "wrapped); put verify: on a rule choosing a quantreg method"))
        if spec.against != FLOAT64 and EXPERTS not in rule.match.layers:  # the dense seam's verify (dense_verify.py)
            problems.append(Problem(
                where[0], where[1], f"rules[{i}].verify.against",
                f"can never run: the rule decides {', '.join(rule.match.layers)} layers, which verify against "
                f"'{FLOAT64}' only, not a second method '{spec.against}'; write against: {FLOAT64}"))
            continue
        if spec.against == FLOAT64:
            continue
        against = methods.get(spec.against)
        if against is None:
            problems.append(Problem(
                where[0], where[1], f"rules[{i}].verify.against",
                f"unknown method '{spec.against}'{did_you_mean(spec.against, sorted(methods))} "
                f"(registered: {name_list(sorted(methods))}; or '{FLOAT64}')"))
            continue
        devices = rule.match.device
        if devices is not None and not any(against.runs_on(d) for d in devices):
            problems.append(Problem(
                where[0], where[1], f"rules[{i}].verify.against",
                f"method '{spec.against}' runs on {', '.join(against.devices)}, never on the rule's device "
                f"({', '.join(devices)}): this verification can never run"))
    return problems


# -- what plugins say beside their methods and tables (asked when a tool needs it) -----------------

def collect_findings(plugins: Plugins, resolve: Resolve, device: str | None) -> list[Finding]:
    """Ask every plugin's ``doctor_findings(register, resolve, device)`` (any subset of the
    three arguments), in registration order, through :meth:`Plugins.call_each` (the one caller:
    containment, "still ..." warning, the type check of each registered ``Finding`` and its
    fields). Raising hooks and bad registrations become ``error`` findings attributed to the plugin."""
    from .findings import HOOK, LEVELS, Finding
    from .host import guess_device

    findings: list[Finding] = []
    # A device always: vLLM's, or (a tool run outside vLLM) the one it would most likely report, so no
    # plugin has to guess it with core's helpers (plugin #1 once imported core's device guess to).
    here = device if device is not None else guess_device()
    for plugin, item in plugins.call_each(HOOK, inline_failures=True, resolve=resolve, device=here):
        if isinstance(item, PluginFailure):
            findings.append(Finding("error", f"hook {HOOK} {printable(item.message)}", plugin=plugin))
        elif item.level not in LEVELS:
            findings.append(Finding("error", f"hook {HOOK} registered level {printable(str(item.level))!r} (expected "
                                    f"one of {', '.join(LEVELS)}): {printable(item.message)}", plugin=plugin))
        else:
            findings.append(remade(Finding, item, message=printable(item.message), plugin=plugin))
    return findings


def plugin_limitations(plugins: Plugins) -> tuple[list[VllmLimitation], list[str]]:
    """Limitations registered by plugins through ``register_vllm_limitations``, and faults.

    A hook that raises is recorded among the registry's plugin failures by
    :meth:`Plugins.call_each`; a wrong item is returned here as a fault line.
    """
    from .vllm_limits import VllmLimitation

    found: list[VllmLimitation] = []
    faults: list[str] = []
    for name, item in plugins.call_each("register_vllm_limitations", inline_failures=True):
        if isinstance(item, VllmLimitation):  # type and fields checked by the one caller (quantreg.hookcall)
            found.append(remade(VllmLimitation, item, plugin=name))
        else:  # a PluginFailure: the hook raised, or registered something that is not a valid VllmLimitation
            faults.append(str(item))
    return found, faults


def all_limitations(plugins: Plugins | None) -> tuple[list[VllmLimitation], list[str]]:
    """Built-in limitations plus those of ``plugins`` (if given), and plugin faults."""
    from .vllm_limits import BUILTIN_LIMITATIONS

    extra, faults = plugin_limitations(plugins) if plugins is not None else ([], [])
    return [*BUILTIN_LIMITATIONS, *extra], faults
