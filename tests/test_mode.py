"""Strict or lenient (:mod:`quantreg.mode`): ``decide_mode`` is the one place it is decided.

History: ``register()`` once ORed in the strictness a driver shipped to its workers
(``multinode.published_strict()``) beside ``decide_mode``, so the seam's later checks and the
CLI did not see it, and ``_strict_now`` existed twice (issue 24.3). Now every vLLM-side caller
asks :func:`quantreg.vllm.startup.mode_of`, which passes the shipped strictness in.
"""

from __future__ import annotations

from typing import Any

import pytest

from quantreg.mode import decide_mode
from quantreg.registry import Registry
from quantreg.vllm import multinode, startup

SHIPPED = "the driver that shipped this process its tables was strict"


def test_shipped_strictness_is_an_input_of_decide_mode() -> None:
    assert not decide_mode({}, ()).strict
    mode = decide_mode({}, (), shipped_strict=True)
    assert mode.strict and mode.because == (SHIPPED,)
    both = decide_mode({"QUANTREG_STRICT": "1"}, (), run_strict=True, shipped_strict=True)
    assert both.because == ("QUANTREG_STRICT=1", 'vLLM additional_config {"quantreg": {"strict": true}}', SHIPPED)


def test_a_worker_is_strict_when_its_driver_shipped_strict(table: Any, clean_env: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's registry is strict by its user table; the worker reads only the shipment."""
    user = table("strict.yaml", "version: 1\nstrict: true\nrules: []\n")
    driver_env = {"QUANTREG_CONFIG": str(user)}
    driver = Registry.build(env=driver_env, entry_points=False)
    assert driver.strict
    driver_env[multinode.FINGERPRINT_ENV] = driver.fingerprint()
    shipment = multinode.publish(driver, driver_env)
    assert shipment is not None and shipment.strict
    worker = Registry.build(env={}, entry_points=False)
    assert not worker.mode().strict  # its own tables and environment say lenient
    monkeypatch.setenv(multinode.TABLES_ENV, driver_env[multinode.TABLES_ENV])
    mode = startup.mode_of(worker, None)
    assert mode.strict and SHIPPED in mode.because
    assert startup.mode_of(None, None).strict  # no registry at all: the shipment still counts
    monkeypatch.delenv(multinode.TABLES_ENV)
    assert not startup.mode_of(worker, None).strict
