"""JSON Schema of a version-1 table, built from the loader's own constants.

Editors use it for completion and early errors; ``tests/test_table_schema.py`` checks that it
accepts and rejects the same documents as :mod:`quantreg.table.file` for everything a schema can
express (method names and ambiguities depend on installed plugins, so only the loader sees them).
"""

from __future__ import annotations

from typing import Any

from .. import keys
from ..bounds import MAX_COUNT, MAX_LAYERS, MAX_PRIORITY, MAX_SIZE
from ..keys import EXPERTS, FIELDS, LAYER, LAYER_KINDS, TOKENS, WILDCARD
from ..methods import EXPERT_LAYOUTS, NAME_RE, TARGET_RE
from .file import RULE_KEYS, SCHEMA_VERSION, TOP_KEYS
from .match import MATCH_VALUE_RE
from .tuned import SHAPE_KEYS
from .verify import FLOAT64, FLOAT64_FORMATS, OLD_SPELLINGS, VERIFY_KEYS

# Python's ``re`` (jsonschema, check-jsonschema) lets ``$`` match before a final newline; the
# lookahead makes the pattern mean what the loader's ``re.fullmatch`` means in every regex dialect.
NAME_PATTERN = NAME_RE + r"(?!\n)"
# ``\w`` is Unicode in Python's re (jsonschema, check-jsonschema), as in the loader; an ECMA-262
# validator without the ``u`` flag reads it as ASCII and is then stricter than the loader.
MATCH_VALUE_PATTERN = MATCH_VALUE_RE + r"(?!\n)"
# ``host``: ``cpu:FLAG``, or ``cpu:A|B`` met by either flag (quantreg.methods.host_requirements_problem)
HOST_RE = r"^cpu:[a-z0-9_]+(\|[a-z0-9_]+)*$(?!\n)"
# ``tokens``: what :meth:`quantreg.keys.TokenRange.parse` accepts (N >= 1; "<N" needs N >= 2)
TOKENS_PATTERN = r"^\s*(?:(?:<=|>=|>)\s*0*[1-9][0-9]*|<\s*0*(?:[2-9]|[1-9][0-9]+))\s*$(?!\n)"


def _tuned_schema(name: dict[str, Any]) -> dict[str, Any]:
    """``tuned:`` (see :mod:`quantreg.table.tuned`): the evidence ``quantreg tune`` writes."""
    number_or_null = {"type": ["number", "null"], "minimum": 0}
    count = {"type": "integer", "minimum": 1, "maximum": MAX_COUNT}
    flags = {"type": "array", "items": {"type": "string", "pattern": "^[^\\s]{1,64}$"}}
    shape: dict[str, Any] = {"type": "object", "additionalProperties": False,
             "properties": {k: {"type": "integer", "minimum": 1, "maximum": MAX_SIZE} for k in SHAPE_KEYS}}
    by_tokens = {"type": "object", "propertyNames": {"pattern": "^[1-9][0-9]*$"}}
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["results"],
        "description": "measurements quantreg tune ordered the chain by; shown by explain, never changes a decision",
        "properties": {
            "at": {"type": "string"}, "vllm": {"type": ["string", "null"]}, "torch": {"type": ["string", "null"]},
            "host": {"type": "object", "additionalProperties": False, "properties": {
                "machine": {"type": "string"}, "kind": {"type": "string"}, "vendor": {"type": "string"},
                "model": {"type": "string"}, "cores": {"type": "integer", "minimum": 1, "maximum": MAX_SIZE},
                "flags": flags, "simulated": {"type": "boolean"}}},
            "shape": {**shape, "properties": {**shape["properties"], "weights": {"type": "string"}}},
            "tolerance": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e9},
            "budget_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e9},
            "rounds": {"type": "integer", "minimum": 0, "maximum": MAX_COUNT},
            "ranking": {"type": "array", "items": {"type": "string"},
                        "description": "each neighbouring pair of the chain: apart beyond noise, or a tie"},
            "load_avg": {"type": "array", "items": {"type": "number"}},
            "pins": {"type": "object", "additionalProperties": False,
                     "description": "what the measurement depends on; checked at start-up",
                     "properties": {
                         "cpu_model": {"type": "string"}, "cpu_flags": flags,
                         "bandwidth_gbs": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e6},
                         "vllm": {"type": ["string", "null"]}, "torch": {"type": ["string", "null"]},
                         "quantreg": {"type": ["string", "null"]},
                         "plugins": {"type": "object", "propertyNames": {"minLength": 1},
                                     "additionalProperties": {"type": ["string", "null"]}},
                         "kernels": {"type": "object", "propertyNames": name,
                                     "additionalProperties": {"type": "string", "pattern": "^[0-9a-f]{64}$"}},
                         "shape": shape}},
            "crossover": {"type": "object", "additionalProperties": False, "required": ["tokens", "small", "large"],
                          "description": "where tune split the key by token count: small serves <= tokens, "
                                         "large above; the envelope's worst median ratio to the fastest and where",
                          "properties": {"tokens": count, "small": name, "large": name,
                                         "worst_ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e9},
                                         "worst_at": count}},
            "phase_weights": {**by_tokens, "minProperties": 1,
                              "additionalProperties": {"type": "number", "minimum": 0}},
            "results": {"type": "array", "items": {
                "type": "object", "required": ["method", "ok"], "additionalProperties": False,
                "properties": {
                    "method": name, "ok": {"type": "boolean"}, "error": {"type": ["string", "null"]},
                    "ms": {**by_tokens, "additionalProperties": number_or_null},
                    "score_ms": number_or_null, "rel_error": number_or_null,
                    "spread": {**by_tokens, "additionalProperties": {"type": "number", "minimum": 0}},
                    "warnings": {"type": "array", "items": {"type": "string"}},
                }}},
        },
    }


def _verify_schema(name: dict[str, Any]) -> dict[str, Any]:
    """``verify:`` (see :mod:`quantreg.table.verify`); ``against: vllm`` is refused, float64 checked per rule."""
    props: dict[str, Any] = {
        "against": {**name, "not": {"const": "vllm"},
                    "description": f"a registered method, or '{FLOAT64}' (the format's float64 reference)"},
        "every": {"type": "integer", "minimum": 1, "maximum": MAX_COUNT,
                  "description": "after the first calls, verify one call in N"},
        "first": {"type": "integer", "minimum": 0, "maximum": MAX_COUNT,
                  "description": "verify the first N forward calls of each layer"},
        "tolerance": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e9,
                      "description": "bound on max|out-ref|/max|ref|"},
        "decoders": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_LAYERS},
                               {"type": "array", "minItems": 1, "maxItems": MAX_LAYERS, "uniqueItems": True,
                                "items": {"type": "integer", "minimum": 0, "maximum": MAX_LAYERS - 1}}],
                     "description": "the first N MoE layers, or a list of decoder-layer indices (model.layers.N)"},
    }
    assert set(props) == set(VERIFY_KEYS)
    for old, new in OLD_SPELLINGS.items():  # still read (one deprecation line), so still valid here
        props[old] = {**props[new], "deprecated": True, "description": f"deprecated spelling of '{new}'"}
    return {"type": "object", "required": ["against"], "additionalProperties": False, "properties": props,
            "not": {"anyOf": [{"required": [old, new]} for old, new in OLD_SPELLINGS.items()]},
            "description": "run a second method beside the chosen one on sampled calls and report the difference"}


def _declared_schema(declared: keys.MatchKey) -> dict[str, Any]:
    """A :data:`quantreg.keys.MATCH_KEYS` key: one value or a non-empty list (no wildcard), as the parser reads it."""
    one: dict[str, Any] = ({"enum": list(declared.values)} if declared.values is not None
                           else {"type": "string", "pattern": MATCH_VALUE_PATTERN, "not": {"const": WILDCARD}})
    return {"anyOf": [one, {"type": "array", "minItems": 1, "items": one}], "description": declared.description}


def table_schema() -> dict[str, Any]:
    name = {"type": "string", "pattern": NAME_PATTERN}
    value = {"type": "string", "pattern": MATCH_VALUE_PATTERN}
    match_value = {
        "anyOf": [
            {"const": WILDCARD},
            {**value, "not": {"const": WILDCARD}},
            {"type": "array", "minItems": 1, "items": {**value, "not": {"const": WILDCARD}}},
        ]
    }
    rule_props: dict[str, Any] = {
        "match": {
            "type": ["object", "null"],
            "additionalProperties": False,
            "properties": {**{f: match_value for f in FIELDS}, LAYER: {
                "anyOf": [{"enum": list(LAYER_KINDS)},
                          {"type": "array", "minItems": 1, "items": {"enum": list(LAYER_KINDS)}}],
                "description": "which layers the rule decides (absent: experts); no wildcard"},
                TOKENS: {"type": "string", "pattern": TOKENS_PATTERN,
                         "description": 'the forward token counts the rule decides: "<=N", "<N", ">N" or ">=N" '
                                        "(absent: every count); experts only"},
                **{k.name: _declared_schema(k) for k in keys.MATCH_KEYS}},
        },
        "method": {
            "anyOf": [name, {"type": "array", "minItems": 1, "uniqueItems": True, "items": name}],
            "description": "a method name or a fallback chain; the first available method wins",
        },
        "options": {"type": ["object", "null"], "description": "keyword arguments handed to the method"},
        "priority": {"type": "integer", "minimum": -MAX_PRIORITY, "maximum": MAX_PRIORITY,
                     "description": "tie-breaker after layer and specificity"},
        "note": {"type": "string"},
        "verify": _verify_schema(name),
        "tuned": _tuned_schema(name),
    }
    assert set(rule_props) == set(RULE_KEYS)
    top_props: dict[str, Any] = {
        "version": {"const": SCHEMA_VERSION},
        "rules": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["match", "method"],
                "additionalProperties": False,
                "properties": rule_props,
                # against: float64 exists only where the rule's quant formats all have a float64 reference
                "if": {"required": ["verify"], "properties": {"verify": {
                    "required": ["against"], "properties": {"against": {"const": FLOAT64}}}}},
                "then": {"properties": {"match": {
                    "type": "object", "required": ["quant_format"],
                    "properties": {"quant_format": {"anyOf": [
                        {"enum": list(FLOAT64_FORMATS)},
                        {"type": "array", "items": {"enum": list(FLOAT64_FORMATS)}}]}}}}},
                # a token range is decided per forward, which only the experts' seam does
                "allOf": [{"if": {"required": ["match"], "properties": {"match": {
                    "type": "object", "required": [TOKENS]}}},
                    "then": {"properties": {"match": {"properties": {LAYER: {
                        "anyOf": [{"const": EXPERTS}, {"type": "array", "items": {"const": EXPERTS}}]}}}}}}],
            },
        },
        "allow_import_targets": {"type": "boolean", "description": "allow this table's methods: section"},
        "methods": {
            "type": "object",
            "description": "methods defined by this (user) table; needs allow_import_targets: true",
            "additionalProperties": {
                "type": "object",
                "required": ["target"],
                "additionalProperties": False,
                "properties": {
                    "target": {"type": "string", "pattern": "^" + TARGET_RE + "$(?!\\n)"},
                    "devices": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
                    "requires": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
                    "host": {"anyOf": [{"type": "string", "pattern": HOST_RE},
                                       {"type": "array", "items": {"type": "string", "pattern": HOST_RE}}],
                             "description": "what the method needs of the host, e.g. [cpu:avx2, cpu:fma]; "
                                            "cpu:A|B is met by either flag"},
                    "options": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
                    "description": {"type": "string"},
                    "layers": {"anyOf": [{"enum": list(LAYER_KINDS)},
                                         {"type": "array", "minItems": 1, "items": {"enum": list(LAYER_KINDS)}}],
                               "description": "the layer kinds the method decides (default experts)"},
                    "expert_layout": {"enum": list(EXPERT_LAYOUTS),
                                      "description": "how the method holds expert weights (quantreg plan)"},
                },
            },
        },
        "strict": {"type": ["boolean", "null"]},
    }
    assert set(top_props) == set(TOP_KEYS)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://quantreg.invalid/schema/table-v1.json",
        "title": "quantreg rule table (version 1)",
        "type": "object",
        "required": ["version", "rules"],
        "additionalProperties": False,
        "properties": top_props,
    }
