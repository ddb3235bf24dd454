"""Count the test cases of each containment class of issue 21 (docs/reliability.md's table).

Why a script: the table must be regenerated from what the tests count, not typed. It runs
``pytest --collect-only -q`` on each class's test files (parametrised cases count one each) and
adds the examples hypothesis draws per run for the property tests (``max_examples`` read from
the test source). Usage: ``python scripts/containment_counts.py`` (prints the Markdown table).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: class -> (what it is, test node ids (file or file::test-prefix))
CLASSES: dict[str, tuple[str, list[str]]] = {
    "1": ("run settings never kill a lenient start; one settings table",
          ["tests/test_settings.py", "plugins/cpu_mxfp4/tests/test_kernel.py::test_a_bad_setting"]),
    "2": ("no hang on special files", ["tests/test_files.py", "tests/test_tune.py::test_tune_on_unreadable",
                                       "tests/e2e/test_audit_vllm.py"]),
    "3": ("the forward pass of a method under test never stops its caller",
          ["tests/e2e/test_verify_contained.py", "tests/test_tune.py::test_tune_refuses_each"]),
    "4": ("one caller for every hook and plugin callable", ["tests/test_hookcall.py",
                                                            "tests/test_hookcall_plugin_faults.py",
                                                            "tests/test_tune.py::test_tune_refuses_each"]),
    "5": ("malformed data never kills a tool: one bounded JSON reader, declared shapes bounded",
          ["tests/test_jsonread.py::test_loads", "tests/test_jsonread.py::test_the_issue",
                                      "tests/test_jsonread.py::test_strings", "tests/test_jsonread.py::test_plan",
                                      "tests/test_jsonread.py::test_lying", "tests/test_jsonread.py::test_an_index",
                                      "tests/test_jsonread.py::test_summarise",
                                      "tests/test_tune.py::test_tune_on_unreadable",
                                      "tests/test_tune.py::test_a_layer_that_cannot_fit"]),
    "6": ("drop exactly the bad piece; the fingerprint check names a process that decides differently",
          ["tests/test_jsonread.py::test_a_shipment", "tests/test_jsonread.py::test_a_bad",
           "tests/test_vllm_multinode.py::test_worker_given_a_tampered", "tests/test_vllm_fingerprint.py",
           "tests/e2e/test_fingerprint_vllm.py"]),
    "7": ("escaped output, strict-JSON trail", ["tests/test_files.py::test_a_trail_that",
                                                "tests/test_files.py::test_trail_lines",
                                                "tests/test_jsonread.py::test_trail_values",
                                                "tests/test_vllm_fingerprint.py::test_a_forged",
                                                "tests/test_tune.py::test_tune_summary_escapes",
                                                "tests/e2e/test_audit_vllm.py::test_the_refusal",
                                                "tests/test_audit.py::test_doctor_on_a_trail_nobody"]),
    "8": ("writes only what the user named (tiny-model, tune --out)",
          ["tests/test_tiny_command.py", "tests/test_tune.py::test_tune_refuses_an_unwritable_out"]),
    "9": ("seam coverage of non-function overrides", ["tests/test_vllm_coverage_descriptors.py"]),
    "10": ("stragglers: non-UTF-8 names, cache repair, slow imports",
           ["tests/test_validate_limits.py::test_non_utf8", "tests/test_validate_limits.py::test_a_truncated",
            "tests/test_hookcall.py::test_a_plugin_import"]),
    "11": ("limits written down: verdict last, verify that can never run",
           ["tests/test_validate_limits.py::test_verify", "tests/test_validate_limits.py::test_validate"]),
    # issue 34 (reliability round 4)
    "12": ("one writer: a non-regular target refused before any work, atomic, nothing left on failure",
           ["tests/test_writing.py", "tests/test_tiny_command.py", "tests/test_newplugin.py::test_a_non_empty"]),
    "13": ("every CLI path ends in a located line (the envelope under --json), exit 1/2: the printer, the last "
           "boundary, directory creation, tune's float64 reference inputs",
           ["tests/test_cli_paths.py", "tests/test_tune_inputs.py"]),
    "14": ("one escaping function for outside strings on terminals and in logs", ["tests/test_escaping.py"]),
    "15": ("messages say the value and what was expected", ["tests/test_messages.py",
                                                            "tests/test_tune_inputs.py::test_shape_problem"]),
    # issue 46 (reliability round 5); 17 and 18 (plugin libraries, host declarations) are written beside these
    "16": ("tuned: evidence read as written: every field checked where the table is read, every reader total, "
           "register() never armed in a process it calls inactive",
           ["tests/test_table_tuned.py", "tests/test_vllm_register.py::test_register_has_one_boundary",
            "tests/test_tune_pins.py::test_simulated_host_flags", "tests/e2e/test_tuned_evidence_vllm.py"]),
    "17": ("a method that builds can run: native code loaded and its ABI checked by the probe and the "
           "constructor, the kit's first-forward check",
           ["plugins/cpu_mxfp4/tests/test_cpu_mxfp4_broken_library.py",
            "tests/test_testing_conformance.py::test_broken_method_fails_with_a_message_naming_what_differs[ForwardRaises",
            "tests/test_testing_conformance.py::test_broken_method_fails_with_a_message_naming_what_differs[ProcessRaises-"]),
    "18": ("a method's host declaration is where its kit passes: passed over with the reason elsewhere",
           ["tests/test_host_chains.py::test_a_requirement_with_alternatives",
            "tests/test_vllm_dense_seam.py::test_int8_for_lm_head",
            "tests/test_tune_dense.py::test_allow_lossy_chains",
            "plugins/cpu_int8_dense/tests/test_check_method.py",
            "plugins/cpu_int8_dense/tests/test_readme.py::test_readme_explain"]),
    "19": ("one decision value with all its sides, read by every consumer (trail summary, strict verdict, verify "
           "plan, doctor, plan)", ["tests/test_decision_sides.py"]),
    "20": ("every number a user writes bounded before any work, with a located message (table fields, CLI "
           "arguments, config.json sizes)", ["tests/test_bounds.py"]),
    "21": ("the round's messages; one word for a table's precedence tier",
           ["tests/test_messages.py::test_a_dense_verify", "tests/test_messages.py::test_doctor_lists",
            "tests/test_messages.py::test_an_ambiguity", "tests/test_messages.py::test_a_strict_failure",
            "tests/test_messages.py::test_tiny_models", "tests/test_messages.py::test_one_word",
            "tests/test_messages.py::test_tune_layers"]),
}


def collected() -> list[str]:
    files = sorted({n.split("::")[0] for _, nodes in CLASSES.values() for n in nodes})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    return [line for line in out.stdout.splitlines() if "::" in line]


def examples_per_property(path: Path) -> dict[str, int]:
    """Test name -> hypothesis ``max_examples`` for tests decorated with @given in ``path``."""
    source = path.read_text(encoding="utf-8")
    named = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+) = hsettings\(max_examples=(\d+)", source, re.M)}
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef):
            continue
        text = [ast.unparse(d) for d in node.decorator_list]
        if not any(t.startswith("given") for t in text):
            continue
        for t in text:
            m = re.search(r"max_examples=(\d+)", t)
            if m:
                found[node.name] = int(m.group(1))
            elif t in named:
                found[node.name] = named[t]
    return found


def main() -> int:
    ids = collected()
    print("| class | what | test cases | property examples per run | test files |")
    print("| --- | --- | --- | --- | --- |")
    for number, (what, nodes) in CLASSES.items():
        mine = [i for i in ids if any(i.startswith(n) for n in nodes)]
        examples = 0
        for path in sorted({n.split("::")[0] for n in nodes}):
            props = examples_per_property(ROOT / path)
            examples += sum(v for k, v in props.items() if any(i.split("::")[1].split("[")[0] == k and
                                                                 i.startswith(path) for i in mine))
        files = ", ".join(sorted({f"`{n.split('::')[0]}`" for n in nodes}))
        print(f"| {number} | {what} | {len(mine)} | {examples} | {files} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
