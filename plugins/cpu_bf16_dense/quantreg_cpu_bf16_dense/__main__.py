"""``python -m quantreg_cpu_bf16_dense``: print the path of the opt-in table."""

from .plugin import table_path

print(table_path())
