"""quantreg-cpu-mxfp4: a quantreg plugin serving GPT-OSS MXFP4 MoE layers on any x86-64 CPU.

The method (:mod:`.method`) keeps the experts packed (MXFP4 nibbles + E8M0 scales) and runs them
with this distribution's kernel (:mod:`.kernel`); :mod:`.plugin` registers it with quantreg and
adds the plugin's rule table (:file:`rules.yaml`). Importing this package imports nothing heavy.
"""
