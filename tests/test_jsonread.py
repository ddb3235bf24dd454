"""quantreg.jsonread and every reader built on it: never a traceback, whatever the bytes (issue 21 class 5, 6).

Properties over bytes (hypothesis) for the bounded reader itself and for each place that reads
JSON from outside: ``config.json``, safetensors headers, the index, trail lines, the
``QUANTREG_TABLES`` payload. Examples from the issue are pinned as cases of their own.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from quantreg import audit, jsonread, plan, settings
from quantreg.models import checkpoint_files
from quantreg.vllm import multinode

FUZZ = hsettings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)
TOKENS = st.lists(st.sampled_from(['{', '}', '[', ']', '"a"', ':', ',', '1', '-0', '1e400', 'NaN', 'Infinity',
                                   '-Infinity', 'true', 'null', '"\\ud800"', '"\\u0000"', '\xff', ' ', '\n']),
                  max_size=40).map(lambda t: "".join(t).encode("utf-8", "surrogatepass"))
DOCS = st.binary(max_size=200) | TOKENS | JSONISH.map(lambda v: json.dumps(v).encode())


@FUZZ
@given(DOCS)
def test_loads_returns_finite_json_or_refuses_with_a_located_message(data: bytes) -> None:
    try:
        value = jsonread.loads(data)
    except jsonread.JsonRefused as exc:
        assert exc.message and (exc.line is None or exc.line >= 1)
        return
    assert "inf" not in json.dumps(value, allow_nan=False).lower() or True  # allow_nan=False raises on non-finite


@pytest.mark.parametrize(("doc", "word"), [
    (b'{"a": NaN}', "NaN"), (b'{"a": Infinity}', "Infinity"), (b"[1e400]", "out of range"),
    (b"[" * 200_000, "nested"), (b'{"a": "\xff"}', "not UTF-8"), (b"1" * 5000, "not readable"),
    (b"\xef\xbb\xbf{}", "byte-order mark"), (b'{"a": 1,}', "not valid JSON")])
def test_the_issue_examples_are_refused(doc: bytes, word: str) -> None:
    with pytest.raises(jsonread.JsonRefused, match=word):
        jsonread.loads(doc)


def test_strings_holding_brackets_do_not_count_as_nesting() -> None:
    assert jsonread.loads(json.dumps({"a": "[" * 1000}).encode()) == {"a": "[" * 1000}


# -- plan: config.json, safetensors headers, the index ---------------------------------------

def _checkpoint(root: Path, config: bytes, header: bytes | None = None, index: bytes | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_bytes(config)
    if header is not None:
        (root / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    if index is not None:
        (root / "model.safetensors.index.json").write_bytes(index)
    return root


CONFIG_FIELDS = st.fixed_dictionaries({}, optional={
    k: JSONISH for k in ("model_type", "num_hidden_layers", "num_local_experts", "hidden_size", "intermediate_size",
                         "num_experts_per_tok", "first_k_dense_replace", "moe_layer_freq", "mlp_only_layers",
                         "decoder_sparse_step", "quantization_config", "text_config", "moe_layers")})


@FUZZ
@given(DOCS | CONFIG_FIELDS.map(lambda d: json.dumps(d).encode()))
def test_plan_reads_any_config_json_without_a_traceback(tmp_path: Path, data: bytes) -> None:
    ck = plan.read_checkpoint(_checkpoint(tmp_path / "ck", data))
    assert all(isinstance(p, str) and "\n" not in p for p in ck.problems)
    assert len(ck.moe_layers) <= checkpoint_files.MAX_LAYERS


TENSOR = st.fixed_dictionaries({}, optional={"shape": JSONISH, "dtype": JSONISH, "data_offsets": JSONISH})


@FUZZ
@given(DOCS | st.dictionaries(st.sampled_from(["model.layers.0.mlp.experts.gate_up_proj_blocks",
                                                "model.layers.99999999999.mlp.experts.down_proj_scales",
                                                "__metadata__"]), TENSOR | JSONISH, max_size=3)
       .map(lambda d: json.dumps(d).encode()))
def test_plan_reads_any_safetensors_header_without_a_traceback(tmp_path: Path, header: bytes) -> None:
    config = json.dumps({"model_type": "gpt_oss", "num_hidden_layers": 1, "num_local_experts": 2}).encode()
    ck = plan.read_checkpoint(_checkpoint(tmp_path / "ck", config, header=header))
    assert all(isinstance(p, str) for p in ck.problems)
    for layer in checkpoint_files.expert_tensors(tmp_path / "ck", []).values():
        assert all(t["bytes"] >= 0 for t in layer.values())


def test_lying_data_offsets_and_huge_layer_counts_are_refused(tmp_path: Path) -> None:
    header = json.dumps({"model.layers.0.mlp.experts.down_proj_blocks":
                         {"dtype": "U8", "shape": [2, 2], "data_offsets": [100, 4]},
                         "model.layers.0.mlp.experts.down_proj_scales":
                         {"dtype": "U8", "shape": [2], "data_offsets": [-5, 2 ** 70]}}).encode()
    config = json.dumps({"model_type": "gpt_oss", "num_hidden_layers": 10 ** 12, "num_local_experts": 2}).encode()
    ck = plan.read_checkpoint(_checkpoint(tmp_path / "ck", config, header=header))
    text = "\n".join(ck.problems)
    assert "num_hidden_layers: expected an integer from 0 to" in text
    assert "down_proj_blocks: expected shape" in text and "down_proj_scales: expected shape" in text
    assert ck.experts["tensors"] == {}


def test_an_index_cannot_send_the_reader_outside_the_checkpoint(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    secret = json.dumps({"model.layers.0.mlp.experts.down_proj_blocks":
                         {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}).encode()
    (outside / "x.safetensors").write_bytes(struct.pack("<Q", len(secret)) + secret)
    index = json.dumps({"weight_map": {"a": "../elsewhere/x.safetensors", "b": str(outside / "x.safetensors"),
                                       "c": 5}}).encode()
    config = json.dumps({"model_type": "gpt_oss", "num_hidden_layers": 1, "num_local_experts": 2}).encode()
    root = _checkpoint(tmp_path / "ck", config, index=index)
    problems: list[str] = []
    assert checkpoint_files.expert_tensors(root, problems) == {}
    text = "\n".join(problems)
    assert "'../elsewhere/x.safetensors' is not a file name inside the checkpoint" in text
    assert f"'{outside / 'x.safetensors'}' is not a file name inside" in text and "(strings)" in text


# -- the trail -----------------------------------------------------------------------------------

@FUZZ
@given(st.lists(DOCS, max_size=6))
def test_summarise_reads_any_trail_without_a_traceback(tmp_path: Path, lines: list[bytes]) -> None:
    trail = tmp_path / "t.jsonl"
    trail.write_bytes(b"\n".join(x.replace(b"\n", b" ") for x in lines))
    summary = audit.summarise(trail)
    assert all("\n" not in p and "\x1b" not in p for p in summary.problems + summary.disagreements)


def test_trail_values_with_escapes_are_escaped(tmp_path: Path) -> None:
    trail = tmp_path / "t.jsonl"
    trail.write_text(json.dumps({"event": "verify", "ok": False, "prefix": "\x1b[31mred\nforged"}) + "\n"
                     + '{"pid": Infinity}\n' + "[" * 100_000 + "\n")
    summary = audit.summarise(trail)
    assert len(summary.problems) == 2  # the Infinity line and the deep one; the verify line is a verified layer
    assert all("\x1b" not in p and "\n" not in p for p in summary.problems)
    rendered = [v.render() for v in summary.verified.values()]
    assert rendered and all("\x1b" not in r and "\n" not in r for r in rendered)


# -- QUANTREG_TABLES ----------------------------------------------------------------------------

def _encoded(payload: object) -> str:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return multinode.ENCODING + base64.b64encode(zlib.compress(raw)).decode()


@FUZZ
@given(DOCS | JSONISH.map(lambda v: json.dumps({"v": 1, "fingerprint": "f", "strict": False, "tables": v,
                                                  "pid": 1}).encode()))
def test_a_shipment_decodes_or_is_refused_never_a_traceback(data: bytes) -> None:
    try:
        shipment = multinode.Shipment.decode(_encoded(data))
    except ValueError as exc:
        assert str(exc)
        return
    assert all(isinstance(t.path, str) for t in shipment.tables)


def test_a_bad_piece_of_a_shipment_is_dropped_alone() -> None:
    good = {"path": "/a.yaml", "sha256": multinode._digest(b"version: 1\n"), "text": "version: 1\n"}
    lying = {"path": "/b.yaml", "sha256": "0" * 64, "text": "version: 1\nrules: []\n"}
    tables = f"[{json.dumps(good)}, {json.dumps(lying)}, 7]"
    raw = ('{"v": 1, "fingerprint": "f", "strict": true, "pid": Infinity, "tables": ' + tables + "}").encode()
    shipment = multinode.Shipment.decode(_encoded(raw))
    assert shipment.pid == 0 and shipment.strict is True
    assert [t.path for t in shipment.tables] == ["/a.yaml", "/b.yaml"]
    assert shipment.tables[0].text == "version: 1\n" and shipment.tables[1].text is None
    assert len(shipment.notes) == 3 and "does not match the sha256" in shipment.notes[1]
    with pytest.raises(ValueError, match="nested"):
        multinode.Shipment.decode(_encoded(b'{"v": 1, "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"))
    with pytest.raises(ValueError, match="decompresses to more than"):
        multinode.Shipment.decode(_encoded(b" " * (multinode.MAX_PAYLOAD + 10)))


def test_a_bad_shipment_warns_once_and_the_process_keeps_deciding(caplog: pytest.LogCaptureFixture) -> None:
    env = {settings.TABLES: _encoded(b'{"v": 1, "fingerprint": "f", "strict": false, "pid": 1e400, '
                                          b'"tables": []}')}
    with caplog.at_level("WARNING", logger="vllm.quantreg"):
        for _ in range(3):
            shipment = multinode.received(env)
            assert shipment is not None and shipment.pid == 0
    assert sum("pid: expected a process id" in r.getMessage() for r in caplog.records) == 1
