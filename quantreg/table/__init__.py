"""The table pipeline: YAML files to located values to schema-v1 rules (no torch, no vLLM)."""
