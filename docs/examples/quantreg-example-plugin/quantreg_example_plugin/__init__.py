"""quantreg-example-plugin: the plugin built step by step in quantreg's docs/writing-a-plugin.md.

Importing the package (or :mod:`.plugin`, which quantreg loads in every vLLM process) imports
neither torch nor vLLM; :mod:`.method` is imported only when a table chooses ``example_mxfp4``.
"""
