"""pytest hooks that log each test's time to the run log (workbook.measure.runlog), when
WORKBOOK_RUNLOG names one: loaded by the repository's conftest.py, and with
`-p workbook.testing.pytest_timings` by the runs of tests outside the repository (make verify's
copy). A test's time is its setup, call and teardown together; its flavour says what it ran on:
the checks' builds (asan, tsan), a carved exercise copy, the emulated CUDA device, or the host.
"""

import collections

from workbook import testing
from workbook.measure import runlog

_seconds: collections.defaultdict = collections.defaultdict(float)


def _flavour(nodeid: str, keywords) -> str:
    checks = runlog.checks_flavour()
    if checks:
        return checks
    if "/exercises/" in nodeid or nodeid.startswith("exercises/"):
        return "exercise"
    return "emulated" if testing.EMULATED and "cuda" in keywords else "host"


def pytest_runtest_logreport(report):
    # Under pytest-xdist a report reaches this hook twice: in the worker that ran the test, and
    # in the controller it is sent to (with its `node`). The worker logs it.
    if not runlog.enabled() or getattr(report, "node", None) is not None:
        return
    _seconds[report.nodeid] += report.duration
    if report.when == "teardown":
        path = str(report.fspath)
        runlog.record("test", report.nodeid, _seconds.pop(report.nodeid),
                      stage=runlog.stage_of(path), flavour=_flavour(path, report.keywords))
