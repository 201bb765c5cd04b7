"""pytest hooks for the emulated CUDA device: loaded by the repository's conftest.py, and with
`-p workbook.testing.pytest_emulated` by the runs of tests outside the repository (make verify's
copy).

Tests of CUDA kernels carry the mark `cuda` (workbook.testing.requires_cuda, and parameters on
the CUDA device). Where those run on the emulated CUDA device (workbook.build.emulate: no GPU
visible, or WORKBOOK_CUDA=emulate), the device is loaded before each such test, and the run ends
with one line saying how many ran emulated, so that no emulated result passes for a GPU's.

Under the race checker (WORKBOOK_RACECHECK=1, workbook.net.racecheck), a case of a CUDA test that
runs in float32 runs in float32 alone: its siblings in the other dtypes (the same test, the same
other parameters, workbook.testing.pytest_failfast.sibling_key) are deselected. The kernels are
templates on the element type: each dtype meets the same barriers and touches the same addresses
in the same order, so the checker, which looks at the order of accesses and not at their values,
sees nothing new in a second one. A case without a float32 sibling (a size that runs in float64
alone, as gradcheck's cases do) still runs.
"""

import collections

import pytest

from workbook import testing
from workbook.build import emulate

_outcomes: collections.Counter = collections.Counter()


def pytest_collection_modifyitems(config, items):
    if not emulate.racecheck():
        return
    # Imported here: pytest rewrites the asserts of a plugin module it imports itself.
    from workbook.testing.pytest_failfast import sibling_key

    cuda = [item for item in items if _is_cuda(item)]
    in_float32 = {sibling_key(item) for item in cuda if "float32" in _id_parts(item)}
    dropped = [item for item in cuda
               if sibling_key(item) in in_float32 and "float32" not in _id_parts(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = set(dropped)
        items[:] = [item for item in items if item not in gone]


def _is_cuda(item) -> bool:
    return item.get_closest_marker("cuda") is not None


def _id_parts(item) -> list[str]:
    """The parts of a parametrized test's id ("emulated_cuda-float32-b1_f1_s1")."""
    return item.callspec.id.split("-") if hasattr(item, "callspec") else []


def pytest_runtest_setup(item):
    if testing.EMULATED and _is_cuda(item):
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
