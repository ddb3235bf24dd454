"""Fixtures for the core tests live in core_support.py (a unique module name, so test files can
import its helpers without clashing with tests/e2e/conftest.py or the plugin's conftest)."""

from core_support import clean_env, module_dir, plugin_site, table, vllm_not_loaded

__all__ = ["clean_env", "module_dir", "plugin_site", "table", "vllm_not_loaded"]
