"""A failing case fails fast: a wrong gradient is reported by gradcheck's fast mode at once
(workbook.testing.assert_gradcheck, without torch's slow-mode rewording); a property that fails
in one dtype skips its other dtypes (workbook/testing/pytest_failfast.py); a test past its time
limit is named (pytest-timeout, and the plugin's backstop for a test stuck in C++)."""

import importlib
import os
import time
from pathlib import Path

import pytest
import torch

from workbook import ops, testing

pytest_plugins = ["pytester"]
# Its tests are on kernels and specs of its own: it runs no stage (workbook.testing.pytest_results
# keeps its results while the files outside stages/ are unchanged).
pytestmark = pytest.mark.reaches()

GRADCHECK = importlib.import_module("torch.autograd.gradcheck")
SLOW_MODE = "_run_slow_mode_and_get_error"
SPEC = ops.get("z2xy")
PLUGIN = "workbook.testing.pytest_failfast"


class WrongGradient(torch.autograd.Function):
    """z = 2x + y, whose backward gives y twice the gradient it has."""

    @staticmethod
    def forward(ctx, x, y):
        return 2 * x + y

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad, 2 * grad


def right(x, y):
    return 2 * x + y


def sample():
    return SPEC.make(SPEC.case("odd_129x7"), dtype=torch.float64)


@pytest.fixture
def slow_mode_calls(monkeypatch):
    """Every call of torch's slow-mode rewording, recorded (it still runs)."""
    calls = []
    original = getattr(GRADCHECK, SLOW_MODE)

    def spy(func, tupled_inputs, outputs, input_idx, output_idx, rtol, atol, eps,
            is_forward_ad):
        calls.append((input_idx, output_idx))
        return original(func, tupled_inputs, outputs, input_idx, output_idx, rtol, atol, eps,
                        is_forward_ad)

    monkeypatch.setattr(GRADCHECK, SLOW_MODE, spy)
    return calls


def test_a_wrong_gradient_fails_in_fast_mode_without_the_slow_mode(slow_mode_calls):
    with pytest.raises(GRADCHECK.GradcheckError) as caught:
        testing.assert_gradcheck(WrongGradient.apply, SPEC, sample(), fast_mode=True)
    assert slow_mode_calls == []
    message = str(caught.value)
    assert "Jacobian mismatch for output 0 with respect to input 1" in message
    assert "input 1 is `y`" in message
    assert "Below, we recompute" not in message
    assert getattr(GRADCHECK, SLOW_MODE).__name__ == "spy", "the rewording was not put back"


def test_torch_alone_runs_the_slow_mode_on_the_same_mismatch(slow_mode_calls):
    """What the test above proves absent: torch's own fast-mode gradcheck calls it."""
    call, tensors = sample().bind(WrongGradient.apply)
    with pytest.raises(GRADCHECK.GradcheckError, match="recompute numerical and analytical"):
        torch.autograd.gradcheck(call, tensors, fast_mode=True)
    assert slow_mode_calls == [(1, 0)]


def test_a_right_gradient_passes(slow_mode_calls):
    testing.assert_gradcheck(right, SPEC, sample(), fast_mode=True)
    testing.assert_gradcheck(right, SPEC, SPEC.make(SPEC.case("3x5"), dtype=torch.float64))
    assert slow_mode_calls == []


def test_a_torch_whose_rewording_differs_keeps_its_own_behaviour(monkeypatch):
    calls = []

    def other(*args):  # another signature: not the function the test base knows
        calls.append(args)
        return "\n(torch's own rewording)"

    monkeypatch.setattr(GRADCHECK, SLOW_MODE, other)
    with pytest.raises(GRADCHECK.GradcheckError, match="torch's own rewording"):
        testing.assert_gradcheck(WrongGradient.apply, SPEC, sample(), fast_mode=True)
    assert len(calls) == 1


# -- the dtypes of a failed case (pytest_failfast) -----------------------------------------------

# As testing.params lays them out: dtype by dtype, the cases within; "small" fails in every dtype
# but float64, "large" passes in all.
PROPERTY = """
import pytest

DTYPES = ["float64", "float32", "float16", "bfloat16"]
PARAMS = [pytest.param(d, c, id=f"cpu-{d}-{c}") for d in DTYPES for c in ["small", "large"]]


@pytest.mark.parametrize(("dtype", "case"), PARAMS)
def test_property(dtype, case):
    assert dtype == "float64" or case == "large", f"{dtype} {case}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: f"torch.{d}")
def test_unrelated(dtype):
    pass


@pytest.mark.parametrize("kind", ["float", "int"])
def test_without_dtypes(kind):
    assert kind == "float"
"""


def outcomes(recorder) -> dict[str, str]:
    """Each test's outcome (the id within the brackets, the function's name before it)."""
    found = {}
    for report in recorder.getreports("pytest_runtest_logreport"):
        if report.when == "call" or not report.passed:
            found.setdefault(report.nodeid.split("::")[-1], report.outcome)
    return found


def skip_reasons(recorder) -> dict[str, str]:
    return {r.nodeid.split("::")[-1]: r.longrepr[2]
            for r in recorder.getreports("pytest_runtest_logreport") if r.skipped}


def test_a_failed_dtype_skips_the_later_dtypes_of_its_case(pytester, monkeypatch):
    monkeypatch.delenv("WORKBOOK_FAILFAST", raising=False)
    pytester.makepyfile(test_property=PROPERTY)
    recorder = pytester.inline_run("-p", PLUGIN)
    seen = outcomes(recorder)
    assert seen == {
        "test_property[cpu-float64-small]": "passed",
        "test_property[cpu-float64-large]": "passed",
        "test_property[cpu-float32-small]": "failed",
        "test_property[cpu-float32-large]": "passed",
        "test_property[cpu-float16-small]": "skipped",
        "test_property[cpu-float16-large]": "passed",
        "test_property[cpu-bfloat16-small]": "skipped",
        "test_property[cpu-bfloat16-large]": "passed",
        **{f"test_unrelated[torch.{d}]": "passed"
           for d in ("float64", "float32", "float16", "bfloat16")},
        "test_without_dtypes[float]": "passed",
        "test_without_dtypes[int]": "failed",
    }
    reasons = skip_reasons(recorder)
    assert set(reasons) == {"test_property[cpu-float16-small]",
                            "test_property[cpu-bfloat16-small]"}
    for reason in reasons.values():
        assert reason.startswith("Skipped: float32 of this case failed: the other dtypes are "
                                 "not run (test_property[cpu-float32-small];")
    assert recorder.ret == pytest.ExitCode.TESTS_FAILED


def test_workbook_failfast_0_runs_every_dtype(pytester, monkeypatch):
    monkeypatch.setenv("WORKBOOK_FAILFAST", "0")
    pytester.makepyfile(test_property=PROPERTY)
    recorder = pytester.inline_run("-p", PLUGIN)
    seen = outcomes(recorder)
    assert [k for k, v in seen.items() if v == "failed"] == [
        "test_property[cpu-float32-small]", "test_property[cpu-float16-small]",
        "test_property[cpu-bfloat16-small]", "test_without_dtypes[int]"]
    assert "skipped" not in seen.values()


def test_a_dtype_that_only_fails_in_setup_skips_its_siblings_too(pytester, monkeypatch):
    monkeypatch.delenv("WORKBOOK_FAILFAST", raising=False)
    pytester.makepyfile(test_setup="""
        import pytest

        @pytest.fixture
        def broken(dtype):
            assert dtype != "float16", "no float16 here"

        @pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
        def test_needs_setup(dtype, broken):
            pass
    """)
    result = pytester.runpytest("-p", PLUGIN, "-rs")
    result.assert_outcomes(errors=1, skipped=2)
    result.stdout.fnmatch_lines(["*float16 of this case failed: the other dtypes are not run*"])


# -- a test past its time limit is named (pytest-timeout, and the backstop) ----------------------


def test_the_repository_sets_a_time_limit(pytestconfig):
    pytest.importorskip("pytest_timeout")
    assert float(pytestconfig.getini("timeout")) >= 300


def test_a_slow_test_fails_by_name_and_the_run_goes_on(pytester):
    pytest.importorskip("pytest_timeout")
    pytester.makepyfile(test_slow="""
        import time

        def test_slow():
            time.sleep(60)

        def test_after():
            pass
    """)
    start = time.perf_counter()
    result = pytester.runpytest_subprocess("-p", PLUGIN, "--timeout=1", "-q")
    assert time.perf_counter() - start < 50
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["FAILED test_slow.py::test_slow - Failed: Timeout*"])


def test_a_test_stuck_where_the_signal_cannot_reach_is_named_and_ended(pytester):
    """The main thread blocks SIGALRM and sleeps: as in a C++ call that never returns, the
    timeout's signal handler never runs; the backstop names the test and ends the process."""
    pytest.importorskip("pytest_timeout")
    pytester.makepyfile(test_stuck="""
        import signal
        import time

        def test_stuck():
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
            time.sleep(60)
    """)
    start = time.perf_counter()
    result = pytester.runpytest_subprocess("-p", PLUGIN, "--timeout=1", "-q")
    assert time.perf_counter() - start < 50
    assert result.ret == 1
    result.stdout.fnmatch_lines(["[[]timeout[]] test_stuck.py::test_stuck: still running *"])
    assert "test_stuck" in result.stdout.str() + result.stderr.str()


def test_a_test_stuck_holding_the_gil_is_ended_by_faulthandler(pytester):
    """C++ that holds the GIL (a pybind11 binding's kernel) stops the backstop's thread too:
    faulthandler, which needs no GIL, dumps the stacks (the test's frame among them) and ends
    the process."""
    pytest.importorskip("pytest_timeout")
    pytester.makepyfile(test_gil="""
        import ctypes
        import signal

        def test_stuck_holding_the_gil():
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
            ctypes.PyDLL(None).sleep(60)
    """)
    start = time.perf_counter()
    result = pytester.runpytest_subprocess("-p", PLUGIN, "--timeout=1", "-q")
    assert time.perf_counter() - start < 50
    assert result.ret == 1
    result.stderr.fnmatch_lines(["Timeout (0:00:02)!", "*in test_stuck_holding_the_gil"])


@pytest.fixture(autouse=True)
def _workbook_on_the_path(monkeypatch):
    """pytester's subprocess runs import the plugin: common/ on their path."""
    common = str(Path(testing.__file__).resolve().parents[2])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [common, os.environ.get(
        "PYTHONPATH")])))
