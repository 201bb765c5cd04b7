"""pytest hooks for the emulated CUDA device: loaded by the repository's conftest.py, and with
`-p workbook.testing.pytest_emulated` by the runs of tests outside the repository (make verify's
copy).

Tests of CUDA kernels carry the mark `cuda` (workbook.testing.requires_cuda, and parameters on
the CUDA device). Where those run on the emulated CUDA device (workbook.build.emulate: no GPU
visible, or WORKBOOK_CUDA=emulate), the device is loaded before each such test, and the run ends
with one line saying how many ran emulated, so that no emulated result passes for a GPU's.
"""

import collections

import pytest

from workbook import testing
from workbook.build import emulate

_outcomes: collections.Counter = collections.Counter()


def pytest_runtest_setup(item):
    if testing.EMULATED and item.get_closest_marker("cuda") is not None:
        emulate.ensure_device()


def pytest_runtest_logreport(report):
    if not testing.EMULATED or "cuda" not in report.keywords:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _outcomes[report.outcome] += 1


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    if not testing.EMULATED or not _outcomes:
        return
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(_outcomes.items()))
    terminalreporter.write_line(
        f"[emulated] {sum(_outcomes.values())} CUDA tests ran on the emulated CUDA device "
        f"(the stages' kernels compiled for the CPU; not a GPU result): {counts}")
