"""`quantreg plan`: real checkpoint directories (config.json + safetensors files) and real tables."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from core_support import REFERENCE, REFERENCE_RUNS

import quantreg
from quantreg import Decision, Finding, Key, loading, vllm_limits
from quantreg import plan as planmod
from quantreg.methods import Method
from quantreg.models import checkpoint_files, moe_config
from quantreg.plugins import Plugins
from quantreg.registry import Registry
from quantreg.vllm_limits import VllmLimitation, vllm_backend_note

pytestmark = pytest.mark.usefixtures("clean_env")

ROOT = Path(__file__).resolve().parents[1]
E, H, INTER = 4, 128, 64  # experts, hidden, intermediate: small but MXFP4-shaped (multiples of 32)
ST_BYTES = {"U8": 1, "BF16": 2, "F32": 4}

ROUTE = """\
version: 1
rules:
  - match: {quant_format: gpt_oss_mxfp4, model_type: gpt_oss, device: cpu}
    method: mxfp4_reference
"""
NO_AMX = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
WITH_AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n"


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A real safetensors file by hand: 8-byte LE header length, JSON header, zero-filled data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = ST_BYTES[dtype]
        for d in shape:
            size *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))


def gpt_oss_config(layers: int = 3, quant: bool = True) -> dict[str, Any]:
    config: dict[str, Any] = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                              "num_hidden_layers": layers, "num_local_experts": E, "experts_per_token": 2,
                              "hidden_size": H, "intermediate_size": INTER, "vocab_size": 256}
    if quant:
        config["quantization_config"] = {"quant_method": "mxfp4"}
    return config


def mxfp4_experts(layer: int) -> dict[str, tuple[str, list[int]]]:
    p = f"model.layers.{layer}.mlp.experts."
    return {p + "gate_up_proj_blocks": ("U8", [E, 2 * INTER, H // 32, 16]),
            p + "gate_up_proj_scales": ("U8", [E, 2 * INTER, H // 32]),
            p + "gate_up_proj_bias": ("BF16", [E, 2 * INTER]),
            p + "down_proj_blocks": ("U8", [E, H, INTER // 32, 16]),
            p + "down_proj_scales": ("U8", [E, H, INTER // 32]),
            p + "down_proj_bias": ("BF16", [E, H]),
            f"model.layers.{layer}.mlp.router.weight": ("BF16", [E, H])}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A 3-layer GPT-OSS MXFP4 checkpoint, experts split over two shards with an index."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(gpt_oss_config()))
    shards = {"model-00001-of-00002.safetensors": [0, 1], "model-00002-of-00002.safetensors": [2]}
    weight_map = {}
    for shard, layers in shards.items():
        tensors = {k: v for layer in layers for k, v in mxfp4_experts(layer).items()}
        write_safetensors(root / shard, tensors)
        weight_map.update({k: shard for k in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root


def packed_bytes() -> int:
    weights = E * (2 * INTER * H + H * INTER)
    return weights // 2 + weights // 32 + E * (2 * INTER + H) * 2


def bf16_bytes() -> int:
    return E * (2 * INTER * H + H * INTER) * 2 + E * (2 * INTER + H) * 2


@pytest.mark.plugin1
def test_mapping_table_key_layers_experts_and_routed_decision(checkpoint: Path, tmp_path: Path) -> None:
    table = tmp_path / "route.yaml"
    table.write_text(ROUTE)
    registry = Registry.build(config=[table])  # the installed hpu_mxfp4 plugin registers mxfp4_reference
    data = planmod.plan(checkpoint, ["cpu", "cuda"], registry, use_vllm=False)
    assert set(data) == {"key", "moe_layers", "experts", "devices", "quant_format_source", "problems"}
    assert data["key"] == {"quant_format": "gpt_oss_mxfp4", "model_type": "gpt_oss"}
    assert "QUANT_FORMAT_MAP" in data["quant_format_source"] and "'mxfp4' -> 'gpt_oss_mxfp4'" in \
        data["quant_format_source"]
    assert data["moe_layers"] == 3 and data["problems"] == []
    ex = data["experts"]
    assert (ex["count"], ex["per_token"], ex["hidden_size"], ex["intermediate_size"]) == (E, 2, H, INTER)
    assert ex["moe_layer_indices"] == [0, 1, 2] and ex["source"] == "config.json + safetensors headers"
    assert ex["tensors"]["gate_up_proj_blocks"] == {"shape": [E, 2 * INTER, H // 32, 16], "dtype": "U8"}
    assert "router.weight" not in " ".join(ex["tensors"])
    # The headers' sizes and the MXFP4 arithmetic agree.
    assert ex["checkpoint_bytes_per_layer"] == packed_bytes() == ex["bytes_per_layer"]["packed"]
    assert ex["bytes_per_layer"]["bf16"] == bf16_bytes()
    cpu = data["devices"]["cpu"]
    assert set(cpu) == {"method", "rule", "expert_bytes", "warnings", "line", "notes", "findings", "vllm_limitation"}
    assert (cpu["method"], cpu["rule"]) == (REFERENCE, f"{table}:3")
    # without torch the reference cannot run: vLLM's own method keeps the packed layout, with a fallback warning
    # a collision line names the run table's rule over plugin #2's packaged one (issue 33): not a fault
    faults = [w for w in cpu["warnings"] if " takes keys " not in w]
    assert cpu["expert_bytes"] == 3 * packed_bytes() and (faults == []) == REFERENCE_RUNS
    cuda = data["devices"]["cuda"]
    assert cuda["method"] == "vllm" and cuda["rule"].endswith("registry.yaml:5")
    assert cuda["expert_bytes"] == 3 * packed_bytes()  # vLLM keeps the checkpoint's packed layout
    text = planmod.render(data, str(checkpoint))
    assert f"cpu       {REFERENCE}" in text and "3 MoE layer(s) [0..2]" in text


def test_a_dequantising_method_holds_bf16(checkpoint: Path, tmp_path: Path) -> None:
    """A user table's method declares its layout (``expert_layout``): core knows no method by name."""
    stub = tmp_path / "qrt_plan_stub.py"
    stub.write_text("class Dequant:\n    def __init__(self, moe_config):\n        pass\n")
    table = tmp_path / "dequant.yaml"
    table.write_text("""\
version: 1
allow_import_targets: true
methods:
  hpu_mxfp4_dequant:
    target: qrt_plan_stub:Dequant
    devices: [cpu]
    expert_layout: bf16
rules:
  - match: {quant_format: gpt_oss_mxfp4, device: cpu}
    method: hpu_mxfp4_dequant
""")
    registry = Registry.build(config=[table], entry_points=False)
    assert not registry.problems, registry.problems
    data = planmod.plan(checkpoint, ["cpu"], registry, use_vllm=False)
    assert data["devices"]["cpu"]["method"] == "hpu_mxfp4_dequant"
    assert data["devices"]["cpu"]["expert_bytes"] == 3 * bf16_bytes()


class _LayoutPlugin:
    """Registers methods the way a plugin does; loading must copy ``expert_layout`` (it once dropped it)."""

    @quantreg.hookimpl
    def register_methods(self, register: Callable[[Method], None]) -> None:
        register(Method("mine", "x.y:Y", expert_layout="bf16"))
        register(Method("other", "x.y:Z"))
        register(Method("odd", "x.y:W", expert_layout="fp3"))


def test_declared_layout_and_undeclared_methods(checkpoint: Path, tmp_path: Path) -> None:
    table = tmp_path / "t.yaml"
    table.write_text(ROUTE.replace("mxfp4_reference", "mine"))
    registry = Registry.build(config=[table], plugins=[("layouts", _LayoutPlugin())])
    assert planmod.layout_of("mine", registry) == "bf16"
    assert planmod.layout_of("other", registry) is None
    assert planmod.layout_of("vllm", registry) == "checkpoint"  # the built-in plugin declares its own
    assert "odd" not in registry.methods
    assert any("method 'odd': expert_layout must be one of checkpoint, packed, bf16 or None, got 'fp3'"
               in str(f) for f in registry.failures)
    data = planmod.plan(checkpoint, ["cpu"], registry, use_vllm=False)
    assert data["devices"]["cpu"]["method"] == "mine"
    assert data["devices"]["cpu"]["expert_bytes"] == 3 * bf16_bytes()


def test_bf16_checkpoint_is_unquantized_and_vllm_holds_bf16(tmp_path: Path) -> None:
    root = tmp_path / "bf16"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(gpt_oss_config(layers=2, quant=False)))
    p = "model.layers.{}.mlp.experts."
    tensors = {}
    for i in range(2):
        tensors[p.format(i) + "gate_up_proj"] = ("BF16", [E, H, 2 * INTER])
        tensors[p.format(i) + "gate_up_proj_bias"] = ("BF16", [E, 2 * INTER])
        tensors[p.format(i) + "down_proj"] = ("BF16", [E, INTER, H])
        tensors[p.format(i) + "down_proj_bias"] = ("BF16", [E, H])
    write_safetensors(root / "model.safetensors", tensors)
    data = planmod.plan(root, ["cpu"], Registry.build(entry_points=False), use_vllm=False)
    assert data["key"]["quant_format"] == "unquantized"
    assert data["devices"]["cpu"]["expert_bytes"] == 2 * bf16_bytes()
    assert data["devices"]["cpu"]["warnings"] == []  # vLLM has a bf16 CPU MoE kernel


@pytest.mark.parametrize(("extra", "layers", "moe"), [
    ({"model_type": "deepseek_v3", "n_routed_experts": 8, "first_k_dense_replace": 2, "moe_layer_freq": 1}, 5,
     [2, 3, 4]),
    ({"model_type": "qwen3_moe", "num_experts": 8, "decoder_sparse_step": 2, "mlp_only_layers": [3]}, 6, [1, 5]),
    ({"model_type": "llama4_text", "num_local_experts": 8, "interleave_moe_layer_step": 2}, 4, [1, 3]),
    ({"model_type": "mixtral", "num_local_experts": 8}, 3, [0, 1, 2]),
    ({"model_type": "llama"}, 3, []),
])
def test_which_layers_are_moe(extra: dict[str, Any], layers: int, moe: list[int]) -> None:
    assert moe_config.moe_layer_indices({"num_hidden_layers": layers, **extra}) == moe


def test_multimodal_text_config_and_no_moe_is_a_problem(tmp_path: Path) -> None:
    root = tmp_path / "mm"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "llama4", "text_config": {
        "num_hidden_layers": 4, "num_local_experts": 16, "interleave_moe_layer_step": 1,
        "hidden_size": 64, "intermediate_size": 64}}))
    data = planmod.plan(root, ["cpu"], Registry.build(entry_points=False), use_vllm=False)
    assert data["moe_layers"] == 4 and data["experts"]["count"] == 16 and data["key"]["model_type"] == "llama4"
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    found = planmod.plan(dense, ["cpu"], Registry.build(entry_points=False), use_vllm=False)
    assert found["moe_layers"] == 0 and "no routed experts" in found["problems"][0]


def test_bad_inputs_are_located_problems(tmp_path: Path, checkpoint: Path) -> None:
    registry = Registry.build(entry_points=False)
    missing = planmod.plan(tmp_path / "nowhere", ["cpu"], registry, use_vllm=False)
    assert missing["problems"] == [f"{tmp_path / 'nowhere' / 'config.json'}: missing (a Hugging Face checkpoint "
                                   "directory has a config.json)"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{\n  "model_type": "gpt_oss",\n  oops\n}')
    data = planmod.plan(broken, ["cpu"], registry, use_vllm=False)
    assert data["problems"][0].startswith(f"{broken / 'config.json'}:3: not valid JSON")
    shard = checkpoint / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:20])  # header cut short
    data = planmod.plan(checkpoint, ["cpu"], registry, use_vllm=False)
    assert any(p.startswith(f"{shard}: not a readable safetensors header: header cut short") for p in data["problems"])
    assert any("implies MoE layers 0..2 but the safetensors files hold expert tensors for layers 0..1" in p
               for p in data["problems"])


def test_header_reader_matches_the_safetensors_package(tmp_path: Path) -> None:
    numpy = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "x.safetensors"
    st.save_file({"model.layers.0.mlp.experts.down_proj_blocks": numpy.zeros((2, 8, 1, 16), numpy.uint8),
                  "w": numpy.zeros((3,), numpy.float32)}, str(path))
    header = checkpoint_files.read_safetensors_header(path)
    assert header["w"]["dtype"] == "F32" and header["w"]["shape"] == [3]
    experts = checkpoint_files.expert_tensors(tmp_path, [])
    assert experts[0]["down_proj_blocks"] == {"shape": [2, 8, 1, 16], "dtype": "U8", "bytes": 256}


def test_cpu_without_amx_gets_the_vllm_cannot_note(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = Key("gpt_oss_mxfp4", "gpt_oss", "cpu")
    """Both host kinds through the host-facts seam (quantreg.host.simulate), on any machine."""
    from quantreg.host import AMX_FLAGS, parse_cpuinfo, simulate

    assert parse_cpuinfo(WITH_AMX)[0] >= set(AMX_FLAGS) and not parse_cpuinfo(NO_AMX)[0] & set(AMX_FLAGS)
    for name, value in simulate("avx2").items():
        monkeypatch.setenv(name, value)
    note = vllm_backend_note(key)
    assert note is not None and note.startswith("vLLM's own method will fail for this key here")
    assert "cpu_moe.py:624" in note and "amx_tile" in note
    assert vllm_backend_note(Key("unquantized", "gpt_oss", "cpu")) is None
    assert vllm_backend_note(Key("gpt_oss_mxfp4", "gpt_oss", "cuda")) is None
    data = planmod.plan(checkpoint, ["cpu"], Registry.build(entry_points=False), use_vllm=False)
    assert data["devices"]["cpu"]["method"] == "vllm"
    assert any("No MXFP4 MoE backend" in w for w in data["devices"]["cpu"]["warnings"])
    for name, value in simulate("amx").items():
        monkeypatch.setenv(name, value)
    assert vllm_backend_note(key) is None


def test_cpu_flags_reads_proc_cpuinfo_format() -> None:
    from quantreg.host import host_facts, parse_cpuinfo

    assert parse_cpuinfo(WITH_AMX)[0] >= {"amx_tile", "amx_bf16"}
    assert parse_cpuinfo("garbage")[0] == frozenset()
    here = host_facts().cpu_flags
    if Path("/proc/cpuinfo").exists():
        assert here  # this Linux host's real flags


def test_custom_limitations_and_checks_that_raise() -> None:
    def boom() -> bool:
        raise RuntimeError("no")

    lims = [VllmLimitation("needs X", quant_format="fp8", device=("xpu", "hpu"), source="a.py:1"),
            VllmLimitation("never shown", applies=boom),
            VllmLimitation("shown", model_type="m", applies="os.path:isdir", source="")]
    assert vllm_backend_note(Key("fp8", "any", "hpu"), lims) == "vLLM's own method will fail for this key here: " \
        "needs X [a.py:1]"
    assert vllm_backend_note(Key("fp8", "any", "cpu"), lims) is None
    assert vllm_backend_note(Key("q", "m", "cpu"), lims) is None  # isdir() without argument raises: not applied


LIMIT = VllmLimitation("the accelerator's runtime has no MXFP4 kernel before v9", quant_format="gpt_oss_mxfp4",
                       device="npu", source="vendor docs")


@quantreg.hookimpl
def register_vllm_limitations(register: Callable[[VllmLimitation], None]) -> None:
    register(LIMIT)


def _limits_plugins(*plugins: tuple[str, object]) -> Plugins:
    pl = Plugins({}, entry_points=False)
    for name, plugin in plugins:
        pl.add(plugin, name)
    return pl


def test_plugins_add_limitations_through_the_hook() -> None:
    pl = _limits_plugins(("npu_vendor", SimpleNamespace(register_vllm_limitations=register_vllm_limitations)))
    found, faults = loading.plugin_limitations(pl)
    assert faults == [] and [f.plugin for f in found] == ["npu_vendor"]
    note = vllm_backend_note(Key("gpt_oss_mxfp4", "gpt_oss", "npu"), [*vllm_limits.BUILTIN_LIMITATIONS, *found])
    assert note == ("vLLM's own method will fail for this key here: the accelerator's runtime has no MXFP4 kernel "
                    "before v9 [vendor docs] (from plugin 'npu_vendor')")


def test_a_bad_limitation_registration_is_a_fault_naming_the_plugin() -> None:
    @quantreg.hookimpl
    def register_vllm_limitations(register: Callable[[object], None]) -> None:
        register("not a limitation")

    pl = _limits_plugins(("sloppy", SimpleNamespace(register_vllm_limitations=register_vllm_limitations)))
    found, faults = loading.plugin_limitations(pl)
    assert found == [] and faults == ["plugin 'sloppy', hook 'register_vllm_limitations': register() expects a "
                                      "quantreg.VllmLimitation, got str"]


class _StackPlugin:
    """A plugin speaking for its device's stack (hook ``doctor_findings``), as plugin #1 does for vllm-gaudi."""

    @quantreg.hookimpl
    def doctor_findings(self, register: Callable[[Finding], None], resolve: Callable[[Key], Decision],
                        device: str | None) -> None:
        if device == "hpu":
            key = Key("gpt_oss_mxfp4", "gpt_oss", "hpu")
            register(Finding("warning", f"my stack strips this config; the table says {resolve(key).method}", key))


def test_plan_asks_the_plugins_and_never_re_derives_their_stack(checkpoint: Path) -> None:
    """Issue 24.1 / 22.3: plan's per-device warnings are the plugins' findings for that key, no core copy."""
    registry = Registry.build(entry_points=False, plugins=[("stack", _StackPlugin())])
    data = planmod.plan(checkpoint, ["hpu", "cpu"], registry, use_vllm=False)
    hpu = data["devices"]["hpu"]
    assert hpu["warnings"] == ["(gpt_oss_mxfp4, gpt_oss, hpu): my stack strips this config; the table says vllm "
                               "[plugin stack]"]
    assert hpu["findings"] == [{"level": "warning", "plugin": "stack", "key": ["gpt_oss_mxfp4", "gpt_oss", "hpu"],
                                "message": "my stack strips this config; the table says vllm"}]
    assert data["devices"]["cpu"]["findings"] == []


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_with_vllm_the_name_comes_from_vllms_quant_config_classes(checkpoint: Path, tmp_path: Path) -> None:
    """A fresh process (vLLM imports stay out of this one); the plan command's JSON output."""
    table = tmp_path / "route.yaml"
    table.write_text(ROUTE)
    code = ("import sys; from quantreg.plan import plan_command; "
            "sys.exit(plan_command(sys.argv[1], ['cpu'], [sys.argv[2]], True))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code, str(checkpoint), str(table)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(done.stdout)
    assert data["key"] == {"quant_format": "gpt_oss_mxfp4", "model_type": "gpt_oss"}
    assert data["quant_format_source"].startswith("vLLM 0.")
    assert "GptOssMxfp4Config.override_quantization_method maps 'mxfp4' to 'gpt_oss_mxfp4'" in \
        data["quant_format_source"]
    assert data["devices"]["cpu"]["method"] == "mxfp4_reference"
    assert data["devices"]["cpu"]["rule"] == f"{table}:3"


@pytest.mark.parametrize("strict", [False, True])
def test_plan_in_strict_mode_says_vllm_would_refuse_and_exits_1(strict: bool, tmp_path: Path) -> None:
    """``plan`` exited 0 with a broken table in strict mode, where the start-up it plans for stops."""
    from quantreg.models.gpt_oss import tiny_gpt_oss_config

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_gpt_oss_config()))
    broken = tmp_path / "broken.yaml"
    broken.write_text("version: 1\nrules:\n  - {match: {device: cpu}, method: nope}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTREG_")} | {"QUANTREG_PLUGINS": ""}
    env |= {"QUANTREG_STRICT": "1"} if strict else {}
    quantreg_cmd = Path(sys.executable).with_name("quantreg")
    out = subprocess.run([str(quantreg_cmd), "plan", str(model), "--no-vllm", "--config", str(broken)],
                         capture_output=True, text=True, env=env, timeout=120)
    refusals = [line for line in out.stderr.splitlines() if line.startswith("vLLM would refuse to start")]
    assert f"problem   {broken}:3: rules[0].method: unknown method 'nope' (registered: vllm)" in out.stdout
    if strict:
        assert out.returncode == 1 and refusals == [
            f"vLLM would refuse to start (QUANTREG_STRICT=1): {broken}:3: rules[0].method: unknown method 'nope' "
            "(registered: vllm)"], out.stderr
    else:
        assert out.returncode == 0 and refusals == [], out.stderr
