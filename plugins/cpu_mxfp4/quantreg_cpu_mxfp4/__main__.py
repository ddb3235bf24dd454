"""``python -m quantreg_cpu_mxfp4``: print the path of the opt-in table ``q8.yaml`` (for ``QUANTREG_CONFIG``)."""

from .plugin import q8_table_path

print(q8_table_path())
