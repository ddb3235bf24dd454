#!/usr/bin/env python3
"""Static check of a vLLM release against what quantreg and plugin #1 rely on, without importing it.

    scripts/vllm_compat_check.py WHEEL_OR_SOURCE_DIR [--json] [--fail-on-bypass]

WHEEL_OR_SOURCE_DIR is a ``.whl`` (read as a zip, members parsed in memory), a directory holding
the ``vllm`` package (a source checkout or site-packages), or the ``vllm`` package directory
itself. Nothing is imported: a CUDA-only release (0.33.0 here) is checked on a CPU machine.

Why static: the runtime matrix (scripts/compat.sh) only covers releases that install and run
here; vLLM's MoE layer code is refactored often, and a renamed seam or a changed signature is
visible in the sources long before anyone runs the release on the hardware it targets.

Reports each entry of ``SYMBOLS`` (the single table of what quantreg/vllm/, quantreg/testing/
harness.py, quantreg/demo/runner.py and plugins/hpu_mxfp4/quantreg_hpu_mxfp4/ use) as
``present``, ``changed`` (signature or abstract-method set differs) or ``missing``, and every
class that overrides the seam ``RoutedExperts._get_quant_method`` (the registry sees such a layer
only if the override calls ``super()``). Exit status: 1 when a required symbol is missing or
changed (``--fail-on-bypass``: also when an override does not call ``super()``), 2 on bad input.

Reading the sources (a wheel or a directory, and resolving names through them) is the sibling
module scripts/vllm_sources.py; this file holds the table of symbols, the checks and the report.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

# The sibling module scripts/vllm_sources.py, also when this file is run as a script or loaded by path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_sources import Found, Resolver, Sources

SEAM_MODULE = "vllm.model_executor.layers.fused_moe.routed_experts"
SEAM_CLASS = "RoutedExperts"
SEAM_METHOD = "_get_quant_method"
SEAM_PARAMS = ("self", "prefix", "quant_config", "moe_config")

FUSED = "vllm.model_executor.layers.fused_moe"
Q = "quantreg/vllm"
H = "quantreg/testing/harness.py"
R = "quantreg/demo/runner.py"
P = "plugins/hpu_mxfp4"


@dataclass(frozen=True)
class Symbol:
    """One thing quantreg needs from vLLM.

    kind: ``module`` (the module exists), ``name`` (a module-level name: def, class, assignment,
    re-export or lazy ``__getattr__``), ``member`` (``Class.attr``: method, property, field or
    ``self.attr = ...`` in the class or its bases), ``abstract`` (the class's abstract methods are
    a subset of ``abstract``), ``string`` (the module contains this string constant).
    params: required leading positional parameters, in order (calls pass them positionally).
    keywords: keyword arguments quantreg passes (accepted by name or by ``**kwargs``).
    accepts: for a method quantreg's own classes implement (vLLM calls *them*): the positional
    parameters that implementation takes; vLLM's signature must be a prefix of it, and any
    keyword-only parameter vLLM adds is a change unless ``accepts_kwargs``.
    optional: quantreg copes without it (``getattr`` with a default): missing is reported, not a failure.
    alternatives: other names quantreg accepts for the same thing (an older release's name, e.g. 0.26's
    ``FusedMoE`` before the ``FusedMoEFactory`` rename): found under one of them, the symbol is present
    (and its signature checked there), reported with the name it was found under.
    modules: other modules quantreg looks in for it, in order after ``module`` (0.34 moved the CPU MoE ops
    from ``vllm._custom_ops`` to ``vllm._cpu_ops``; quantreg/vllm/cpu_ops.py takes either).
    """

    kind: str
    module: str
    name: str
    used_by: str
    params: tuple[str, ...] | None = None
    keywords: tuple[str, ...] = ()
    abstract: frozenset[str] = frozenset()
    accepts: tuple[str, ...] | None = None
    accepts_kwargs: bool = False
    optional: bool = False
    alternatives: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()


# The one table. Order: the seam, the key and settings, plugin #1's base classes, the kit's harness, the demo runner.
SYMBOLS: tuple[Symbol, ...] = (
    Symbol("member", SEAM_MODULE, f"{SEAM_CLASS}.{SEAM_METHOD}", f"{Q}/seam.py, {H}", params=SEAM_PARAMS),
    Symbol("string", "vllm.plugins", "vllm.general_plugins", "pyproject.toml entry point group"),
    Symbol("name", "vllm.plugins", "load_general_plugins", f"{Q}/__init__.py (vLLM calls register())"),
    Symbol("name", "vllm.config", "get_current_vllm_config_or_none", f"{Q}/context.py, {R}, {P}/routing.py",
           params=()),
    Symbol("name", "vllm.config", "get_current_vllm_config", f"{P}/routing.py (fallback)", optional=True),
    Symbol("member", "vllm.config", "VllmConfig.model_config", f"{Q}/context.py"),
    Symbol("member", "vllm.config", "VllmConfig.additional_config", f"{Q}/context.py"),
    Symbol("member", "vllm.config", "ModelConfig.hf_config", f"{Q}/context.py"),
    Symbol("name", "vllm.platforms", "current_platform", f"{Q}/context.py"),
    Symbol("member", "vllm.platforms.interface", "Platform.device_type", f"{Q}/context.py"),
    Symbol("name", "vllm.model_executor.layers.quantization.base_config", "QuantizationConfig.get_name",
           f"{Q}/context.py (the key's quant_format)", params=("self",)),
    Symbol("name", f"{FUSED}.fused_moe_method_base", "FusedMoEMethodBase", f"{P}/method.py, {R}",
           params=("self", "moe")),
    Symbol("abstract", f"{FUSED}.fused_moe_method_base", "FusedMoEMethodBase", f"{P}/method.py",
           abstract=frozenset({"create_weights", "get_fused_moe_quant_config", "apply"})),
    Symbol("member", f"{FUSED}.fused_moe_method_base", "FusedMoEMethodBase.apply", f"{P}/method.py (implements)",
           accepts=("self", "layer", "x", "topk_weights", "topk_ids", "shared_experts", "shared_experts_input")),
    Symbol("member", f"{FUSED}.fused_moe_method_base", "FusedMoEMethodBase.apply_monolithic",
           f"{P}/method.py (implements)", accepts=("self", "layer", "x", "router_logits", "input_ids"),
           accepts_kwargs=True),
    Symbol("member", f"{FUSED}.fused_moe_method_base", "FusedMoEMethodBase.is_monolithic", f"{P}/method.py"),
    Symbol("member", f"{FUSED}.fused_moe_method_base", "FusedMoEMethodBase.process_weights_after_loading",
           f"{P}/method.py (implements)", accepts=("self", "layer")),
    Symbol("member", f"{FUSED}.fused_moe_method_base", "FusedMoEMethodBase.get_fused_moe_quant_config",
           f"{P}/method.py (implements)", accepts=("self", "layer")),
    Symbol("name", "vllm.model_executor.layers.quantization.mxfp4", "GptOssMxfp4MoEMethod",
           f"{P}/method.py (base class), {R}"),
    Symbol("member", "vllm.model_executor.layers.quantization.mxfp4", "GptOssMxfp4MoEMethod.create_weights",
           f"{P}/method.py (inherited)",
           params=("self", "layer", "num_experts", "hidden_size", "intermediate_size_per_partition", "params_dtype")),
    Symbol("name", "vllm.model_executor.layers.quantization.mxfp4", "GptOssMxfp4Config", H),
    Symbol("member", f"{FUSED}.config", "FusedMoEConfig.ep_rank", f"{P}/method.py"),
    Symbol("member", f"{FUSED}.config", "FusedMoEConfig.dp_size", f"{P}/method.py"),
    Symbol("member", f"{FUSED}.config", "FusedMoEConfig.is_sequence_parallel", f"{P}/method.py"),
    Symbol("member", f"{FUSED}.config", "FusedMoEConfig.max_capture_size", f"{P}/method.py", optional=True),
    Symbol("name", f"{FUSED}.config", "biased_moe_quant_config", f"{P}/method.py", params=("w1_bias", "w2_bias")),
    Symbol("name", f"{FUSED}.config", "FUSED_MOE_UNQUANTIZED_CONFIG", f"{P}/method.py"),
    Symbol("name", f"{FUSED}.config", "FusedMoEParallelConfig", H,
           keywords=("tp_size", "pcp_size", "dp_size", "ep_size", "tp_rank", "pcp_rank", "dp_rank", "ep_rank",
                     "sp_size", "use_ep", "all2all_backend", "enable_eplb")),
    Symbol("member", SEAM_MODULE, f"{SEAM_CLASS}.quant_method", f"{H}, {R}"),
    Symbol("member", SEAM_MODULE, f"{SEAM_CLASS}.moe_config", f"{P}/method.py"),
    Symbol("member", SEAM_MODULE, f"{SEAM_CLASS}.local_num_experts", f"{P}/method.py, {H}"),
    Symbol("member", SEAM_MODULE, f"{SEAM_CLASS}.global_num_experts", f"{P}/method.py"),
    Symbol("member", SEAM_MODULE, f"{SEAM_CLASS}.activation", f"{P}/method.py"),
    Symbol("member", SEAM_MODULE, f"{SEAM_CLASS}.top_k", f"{P}/routing.py"),
    Symbol("member", SEAM_MODULE, f"{SEAM_CLASS}.expert_map", H),
    Symbol("member", SEAM_MODULE, f"{SEAM_CLASS}.use_grouped_topk", f"{P}/routing.py", optional=True),
    Symbol("member", SEAM_MODULE, f"{SEAM_CLASS}.custom_routing_function", f"{P}/routing.py", optional=True),
    Symbol("member", SEAM_MODULE, f"{SEAM_CLASS}.router", f"{P}/routing.py (hasattr)", optional=True),
    Symbol("name", f"{FUSED}.layer", "FusedMoEFactory", f"{H}, {P}/tests", alternatives=("FusedMoE",),
           keywords=("num_experts", "top_k", "hidden_size", "intermediate_size", "params_dtype", "renormalize",
                     "quant_config", "prefix", "apply_router_weight_on_input", "has_bias", "activation",
                     "tp_size", "dp_size", "pcp_size", "reduce_results")),
    Symbol("name", f"{FUSED}.layer", "make_parallel_config", f"{H} (replaced for expert parallel)"),
    Symbol("member", f"{FUSED}.runner.moe_runner", "MoERunner.routed_experts", H),
    Symbol("member", f"{FUSED}.runner.moe_runner", "MoERunner.forward", H,
           params=("self", "hidden_states", "router_logits")),
    Symbol("member", f"{FUSED}.router.fused_moe_router", "FusedMoERouter.select_experts", f"{P}/routing.py",
           keywords=("hidden_states", "router_logits")),
    Symbol("name", f"{FUSED}.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod", R),
    Symbol("name", "vllm.config", "set_current_vllm_config", H, params=("vllm_config",)),
    Symbol("name", "vllm.config", "VllmConfig", H, keywords=("model_config",)),
    Symbol("name", "vllm.config", "ModelConfig", H, keywords=("model", "skip_tokenizer_init", "dtype")),
    Symbol("name", "vllm.forward_context", "set_forward_context", f"{H}, {R}", params=("attn_metadata", "vllm_config")),
    Symbol("name", "vllm.model_executor.model_loader.weight_utils", "default_weight_loader", H,
           params=("param", "loaded_weight")),
    Symbol("name", "vllm", "LLM", R),
    # vLLM's CPU MoE ops, through quantreg/vllm/cpu_ops.py (bench/ and the shim's callers): 0.34 moved them
    # from vllm._custom_ops to vllm._cpu_ops; fused_experts_cpu's act_method (CPUActMethod) since 0.33.
    Symbol("name", "vllm._cpu_ops", "fused_experts_cpu", f"{Q}/cpu_ops.py", modules=("vllm._custom_ops",),
           params=("out", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "moe_comp_method", "w1_scale",
                   "w2_scale", "w1_zero", "w2_zero", "block_size"), keywords=("alpha", "limit"), optional=True),
    Symbol("name", "vllm._cpu_ops", "CPUActMethod", f"{Q}/cpu_ops.py (0.33+: passed as act_method)",
           modules=("vllm._custom_ops",), optional=True),
    Symbol("name", "vllm._cpu_ops", "CPUQuantMethod", f"{Q}/cpu_ops.py", modules=("vllm._custom_ops",),
           optional=True),
    Symbol("name", "vllm._cpu_ops", "cpu_fused_moe", f"{Q}/cpu_ops.py, bench/cpu_mxfp4_bench.py",
           modules=("vllm._custom_ops",), params=("out", "input", "w13", "w2", "w13_bias", "w2_bias",
                                                  "topk_weights", "topk_ids", "act", "isa"), optional=True),
    Symbol("name", "vllm._cpu_ops", "cpu_prepack_moe_weight", "bench/cpu_mxfp4_bench.py",
           modules=("vllm._custom_ops",), params=("weight", "isa"), optional=True),
    Symbol("name", "vllm", "SamplingParams", R),
    Symbol("name", "vllm.inputs", "TokensPrompt", R),
)




# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def _function_of(resolver: Resolver, found: Found) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef | None,
                                                            tuple[str, ...] | None]:
    """The callable's def (a class: its ``__init__``), or (None, dataclass fields) for a dataclass."""
    node = found.node
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return node, None
    if isinstance(node, ast.ClassDef):
        init = resolver.member(found, "__init__")
        if init is not None and isinstance(init[1], ast.FunctionDef):
            return init[1], None
        fields: list[str] = []
        for _, cls in resolver.mro(found):
            fields += [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
        return None, tuple(fields)
    return None, None


def _describe(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    return f"({ast.unparse(fn.args)})"


def check_signature(resolver: Resolver, symbol: Symbol, found: Found, member: ast.AST | None = None) -> str | None:
    """``None`` when the call quantreg makes still fits, else what differs."""
    if symbol.params is None and not symbol.keywords and symbol.accepts is None:
        return None
    if member is not None:
        fn = member if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef) else None
        fields = None
    else:
        fn, fields = _function_of(resolver, found)
    if fn is None:
        if fields is not None:  # a dataclass: keywords are its fields
            lacking = [k for k in symbol.keywords if k not in fields]
            return f"no field(s) {', '.join(lacking)}" if lacking else None
        return None  # an assignment or lazy name: nothing to compare
    args = fn.args
    positional = [a.arg for a in [*args.posonlyargs, *args.args]]
    defaults = len(args.defaults)
    if symbol.params is not None:
        want = list(symbol.params)
        if positional[: len(want)] != want:
            return f"expected leading parameters ({', '.join(want)}), found {_describe(fn)}"
        required_extra = positional[len(want): len(positional) - defaults]
        if required_extra:
            return f"new required parameter(s) {', '.join(required_extra)}: {_describe(fn)}"
        kw_required = [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None]
        if kw_required:
            return f"new required keyword-only parameter(s) {', '.join(kw_required)}: {_describe(fn)}"
    if symbol.accepts is not None:
        ours = list(symbol.accepts)
        if positional != ours[: len(positional)]:
            return f"vLLM calls it as {_describe(fn)}; quantreg's implementation takes ({', '.join(ours)})"
        new_kw = [a.arg for a in args.kwonlyargs if a.arg not in ours]
        if new_kw and not symbol.accepts_kwargs:
            return f"new keyword-only parameter(s) {', '.join(new_kw)} quantreg's implementation lacks: {_describe(fn)}"
    if symbol.keywords and args.kwarg is None:
        accepted = {*positional, *(a.arg for a in args.kwonlyargs)}
        lacking = [k for k in symbol.keywords if k not in accepted]
        if lacking:
            return f"no parameter(s) {', '.join(lacking)}: {_describe(fn)}"
    return None


def _where(resolver: Resolver, module: str, node: ast.AST | None) -> str:
    rel = resolver.src.module_file(module) or module
    line = getattr(node, "lineno", None)
    return f"{rel}:{line}" if line else rel


def _abstract_methods(resolver: Resolver, found: Found) -> set[str]:
    names: set[str] = set()
    for _, cls in resolver.mro(found):
        for node in cls.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
                    (isinstance(d, ast.Name) and d.id == "abstractmethod")
                    or (isinstance(d, ast.Attribute) and d.attr == "abstractmethod") for d in node.decorator_list):
                names.add(node.name)
    return names


def check_symbol(resolver: Resolver, symbol: Symbol) -> dict[str, object]:
    entry: dict[str, object] = {"symbol": f"{symbol.module}.{symbol.name}", "kind": symbol.kind,
                                "used_by": symbol.used_by, "optional": symbol.optional}

    def result(status: str, detail: str = "", where: str = "") -> dict[str, object]:
        entry.update(status=status, detail=detail, where=where)
        return entry

    owner = symbol.name.partition(".")[0]
    for module in symbol.modules:  # an older (or newer) home of the same name, when the first has none
        if resolver.src.module_file(symbol.module) is not None and resolver.find(symbol.module, owner) is not None:
            break
        if resolver.src.module_file(module) is not None and resolver.find(module, owner) is not None:
            entry["found_in"] = module
            symbol = Symbol(**{**symbol.__dict__, "module": module, "modules": ()})
            break
    rel = resolver.src.module_file(symbol.module)
    homes = [m for m in symbol.modules if resolver.src.module_file(m) is not None]
    if rel is None and homes:
        return result("missing", f"{homes[0]} defines no {owner} (and there is no module {symbol.module})")
    if rel is None:
        return result("missing", f"no module {symbol.module}")
    if symbol.kind == "module":
        return result("present", where=rel)
    if symbol.kind == "string":
        tree = resolver.src.parse(symbol.module)
        has = tree is not None and any(isinstance(n, ast.Constant) and n.value == symbol.name for n in ast.walk(tree))
        return result("present" if has else "missing", "" if has else f"no string {symbol.name!r}", rel)
    owner_name, _, member_name = symbol.name.partition(".")
    found = resolver.find(symbol.module, owner_name)
    found_as = ""
    for alternative in symbol.alternatives if found is None else ():
        found = resolver.find(symbol.module, alternative)
        if found is not None:
            found_as = alternative
            entry["found_as"] = alternative
            break
    if found is None:
        also = "".join(f" (nor {a})" for a in symbol.alternatives)
        return result("missing", f"{symbol.module} defines no {owner_name}{also}")
    where = _where(resolver, found.module, found.node)
    if found_as:
        where = f"{where} (as {found_as}, a name quantreg also takes)"
    if symbol.kind == "abstract":
        actual = _abstract_methods(resolver, found)
        new = sorted(actual - symbol.abstract)
        if new:
            return result("changed", f"new abstract method(s) {', '.join(new)} (quantreg's methods implement "
                                     f"{', '.join(sorted(symbol.abstract))})", where)
        return result("present", f"abstract: {', '.join(sorted(actual))}", where)
    if member_name:
        hit = resolver.member(found, member_name)
        if hit is None:
            return result("missing", f"{owner_name} (at {where}) has no {member_name}")
        where = _where(resolver, hit[0], hit[1])
        problem = check_signature(resolver, symbol, found, hit[1])
    else:
        problem = check_signature(resolver, symbol, found)
    return result("changed", problem, where) if problem else result("present", where=where)


def _calls_super(fn: ast.FunctionDef | ast.AsyncFunctionDef, class_names: set[str]) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == SEAM_METHOD:
            owner = node.func.value
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                return True
            if isinstance(owner, ast.Name) and owner.id in class_names:  # RoutedExperts._get_quant_method(self, ...)
                return True
    return False


def find_overrides(resolver: Resolver) -> list[dict[str, object]]:
    """Every ``RoutedExperts`` subclass (through any chain of bases) that defines ``_get_quant_method``."""
    seam = resolver.find(SEAM_MODULE, SEAM_CLASS)
    seam_node = seam.node if seam is not None else None
    overrides: list[dict[str, object]] = []
    for rel in resolver.src.files():
        text = resolver.src.read(rel)
        if SEAM_METHOD not in text or f"def {SEAM_METHOD}" not in text:
            continue
        module = rel[: -len("/__init__.py")] if rel.endswith("/__init__.py") else rel[: -len(".py")]
        module = module.replace("/", ".")
        tree = resolver.src.parse(module)
        if tree is None:
            continue
        for cls in ast.walk(tree):
            if not isinstance(cls, ast.ClassDef) or cls is seam_node:
                continue
            fn = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == SEAM_METHOD), None)
            if fn is None:
                continue
            chain = [c for _, c in resolver.mro(Found(module, cls))]
            if seam_node is not None and seam_node not in chain:
                continue
            names = {c.name for c in chain[1:]}
            overrides.append({"class": cls.name, "module": module, "where": f"{rel}:{cls.lineno}",
                              "bases": [ast.unparse(b) for b in cls.bases],
                              "calls_super": _calls_super(fn, names), "signature": _describe(fn)})
    return overrides


@dataclass
class Report:
    source: str
    version: str | None
    symbols: list[dict[str, object]] = field(default_factory=list)
    overrides: list[dict[str, object]] = field(default_factory=list)

    @property
    def failures(self) -> list[dict[str, object]]:
        return [s for s in self.symbols if s["status"] != "present" and not s["optional"]]

    @property
    def bypasses(self) -> list[dict[str, object]]:
        return [o for o in self.overrides if not o["calls_super"]]

    def as_dict(self) -> dict[str, object]:
        counts = {status: sum(1 for s in self.symbols if s["status"] == status and not s["optional"])
                  for status in ("present", "changed", "missing")}
        counts["optional_present"] = sum(1 for s in self.symbols if s["status"] == "present" and s["optional"])
        counts["optional_absent"] = sum(1 for s in self.symbols if s["status"] != "present" and s["optional"])
        return {"source": self.source, "vllm_version": self.version, "counts": counts,
                "ok": not self.failures, "symbols": self.symbols, "overrides": self.overrides}

    def text(self) -> str:
        lines = [f"vLLM {self.version or '(version unknown)'} from {self.source}"]
        width = max(len(str(s["symbol"])) for s in self.symbols)
        for s in self.symbols:
            status = str(s["status"]) + (" (optional)" if s["optional"] and s["status"] != "present" else "")
            detail = s["detail"] or s["where"]
            lines.append(f"  {status:<18} {s['symbol']:<{width}}  {detail}")
        counts = self.as_dict()["counts"]
        lines.append(f"symbols: {counts}")
        if not self.overrides:
            lines.append(f"no {SEAM_CLASS} subclass overrides {SEAM_METHOD}")
        for o in self.overrides:
            how = "calls super(): the seam sees it" if o["calls_super"] else \
                "WITHOUT super(): the seam never sees these layers"
            bases = o["bases"]
            assert isinstance(bases, list)
            lines.append(f"  override {o['class']} ({', '.join(map(str, bases))}) at {o['where']}: {how}")
        return "\n".join(lines)


def check(target: Path) -> Report:
    sources = Sources(target)
    resolver = Resolver(sources)
    report = Report(str(target), sources.version())
    report.symbols = [check_symbol(resolver, s) for s in SYMBOLS]
    report.overrides = find_overrides(resolver)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", type=Path, help="a vLLM .whl, or a directory holding (or being) the vllm package")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--fail-on-bypass", action="store_true",
                        help=f"exit 1 also when a {SEAM_CLASS} subclass overrides {SEAM_METHOD} without super()")
    args = parser.parse_args(argv)
    if not args.target.exists():
        print(f"vllm_compat_check: {args.target}: no such file or directory", file=sys.stderr)
        return 2
    try:
        report = check(args.target)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.text())
    return 1 if report.failures or (args.fail_on_bypass and report.bypasses) else 0


if __name__ == "__main__":
    sys.exit(main())
