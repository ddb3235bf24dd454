"""quantreg's plugin author kit: a conformance suite any MoE-method plugin runs in its own CI.

Three ways in, one suite (:mod:`quantreg.testing.checks`):

* ``quantreg check-method NAME [--device cpu] [--json]`` prints a pass/fail table, exit 0/1;
* the pytest plugin (:mod:`quantreg.testing.pytest_plugin`, entry point group ``pytest11``)::

      @pytest.mark.quantreg_method("my_method")
      def test_conformance(quantreg_check):
          quantreg_check()          # one test item per check: pass, fail with the detail, or skip

  plus fixtures that build real vLLM MoE layers (``moe_harness``) for a plugin's own tests;
* :func:`run_checks` from Python, returning a :class:`Report`.

Importing this package imports neither torch nor vLLM (the pytest plugin is loaded by every
pytest run in an environment where quantreg is installed); the checks import them when they run.
"""

from ..error_measure import DEFAULT_TOLERANCE
from .api import check_method_command, run_checks
from .checks import CHECK_IDS, CHECKS
from .report import CheckResult, Report, Status

__all__ = [
    "CHECKS",
    "CHECK_IDS",
    "DEFAULT_TOLERANCE",
    "CheckResult",
    "Report",
    "Status",
    "check_method_command",
    "run_checks",
]
