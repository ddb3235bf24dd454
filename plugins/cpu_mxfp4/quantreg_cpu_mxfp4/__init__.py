"""quantreg-cpu-mxfp4: MXFP4 MoE experts on any x86-64 CPU with a compiled AVX2 / AVX-512 kernel.

:mod:`quantreg_cpu_mxfp4.kernel` is the kernel's Python API; importing this package imports nothing
heavy (no torch).
"""
