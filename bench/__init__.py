"""quantreg benchmarks (issue 5): what quantreg costs vLLM, how it scales, how fast MXFP4 decodes.

Run ``python bench/run.py [--quick] [--json PATH]`` from the repository root. Benchmarks live here,
never in the unit tests, because their numbers depend on the machine and its load.
"""
