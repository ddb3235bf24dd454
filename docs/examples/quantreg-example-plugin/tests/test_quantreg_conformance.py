"""The plugin's CI: quantreg's conformance suite, one test item per check."""

import pytest


@pytest.mark.quantreg_method("example_mxfp4")
def test_conformance(quantreg_check):
    quantreg_check()
