"""pytest hooks that keep a failing case from costing more than a passing one: loaded by the
repository's conftest.py, and with `-p workbook.testing.pytest_failfast` by runs of tests outside
the repository.

A case's dtypes are siblings. A test parametrized over dtypes (a dtype's name is one
part of its id, as testing.params writes them, "emulated_cuda-float32-b2_q7_m2_d30_l2_p3", or as
ids=str writes a torch.dtype, "torch.float32") that fails, in setup or call, has its later
siblings skipped: the same test function, the same other parameters, another dtype. One wrong
kernel fails every dtype of every case alike, and on the emulated CUDA device each costs
seconds to minutes; the first failure says what there is to say. The failure still fails the
run, and a sibling is skipped only after one of its own siblings failed.
WORKBOOK_FAILFAST=0 runs every sibling.

A test that hangs is named. pytest-timeout (pinned in requirements.txt, its limit in
pyproject.toml: `timeout`, PYTEST_TIMEOUT or --timeout) fails a test past its limit by a signal,
which Python handles only between bytecodes: a test stuck in C++ (a kernel that never returns)
would hang the run. Past the limit and a grace period, this plugin says which test is stuck,
then has pytest-timeout dump every thread's stack and end the process; where C++ code holds the
GIL, which that needs, faulthandler does it after a second grace period (its stacks show the
test's function).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading

import pytest

FAILFAST = "WORKBOOK_FAILFAST"  # "0": run every dtype of a case whose other dtypes failed

# The dtypes' names as torch prints them, without "torch." (workbook.spec.dtype_name).
DTYPE_NAMES = frozenset({"float16", "bfloat16", "float32", "float64",
                         "complex32", "complex64", "complex128"})

_failed_siblings = pytest.StashKey[dict]()  # sibling_key: (the failed dtype, the test's name)
_stderr = pytest.StashKey[int]()  # the terminal's stderr, for faulthandler's last word


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    config.stash[_failed_siblings] = {}
    with contextlib.suppress(AttributeError, OSError, ValueError):  # none: no last word
        # pytest captures nothing while plugins are configured: the terminal's own stderr
        config.stash[_stderr] = os.dup(sys.__stderr__.fileno())


def pytest_unconfigure(config):
    if _stderr in config.stash:
        os.close(config.stash[_stderr])
        del config.stash[_stderr]


def _enabled() -> bool:
    return os.environ.get(FAILFAST, "1").strip() != "0"


def _dtype_of(part: str) -> str | None:
    name = part.removeprefix("torch.")
    return name if name in DTYPE_NAMES else None


def sibling_key(item: pytest.Item) -> tuple | None:
    """What the item's dtype siblings share: its function and the parts of its parameters' id
    that name no dtype (None: it has no dtype in its id)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    parts = callspec.id.split("-")  # how pytest joins parameters' ids, and testing.Params too
    if not any(_dtype_of(p) for p in parts):
        return None
    masked = tuple("<dtype>" if _dtype_of(p) else p for p in parts)
    return (item.nodeid.partition("[")[0], masked)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    failed = item.config.stash.get(_failed_siblings, {})
    key = sibling_key(item) if failed and _enabled() else None
    if key in failed:
        dtype, name = failed[key]
        pytest.skip(f"{dtype} of this case failed: the other dtypes are not run "
                    f"({name}; {FAILFAST}=0 runs them)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and report.when in ("setup", "call") and _enabled():
        key = sibling_key(item)
        if key is not None:
            dtypes = [d for d in map(_dtype_of, item.callspec.id.split("-")) if d]
            item.config.stash[_failed_siblings].setdefault(key, ("/".join(dtypes), item.name))
    return report


# -- a test stuck where pytest-timeout's signal cannot reach -------------------------------------

_backstop = pytest.StashKey[threading.Timer]()


def _stuck(item, settings, after: float) -> None:
    import pytest_timeout

    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:  # what the test printed is shown after this line
        capture.suspend_global_capture(item)
    item.config.get_terminal_writer().line(
        f"\n[timeout] {item.nodeid}: still running {after:.0f} s after its "
        f"{settings.timeout:.0f} s limit, where the timeout's signal cannot stop it (C++: a "
        f"kernel that never returns?); every thread's stack follows, then the process ends",
        red=True, flush=True)
    pytest_timeout.timeout_timer(item, settings)  # dumps the stacks, then os._exit(1)


@pytest.hookimpl(optionalhook=True, wrapper=True)
def pytest_timeout_set_timer(item, settings):
    """After pytest-timeout's own timer: past the limit and a grace period, a thread names the
    test and ends the process; past a second grace period (the first needs the GIL, which C++
    code may hold), faulthandler dumps every thread's stack, the test's frame among them, and
    ends it."""
    result = yield
    if settings.timeout and settings.timeout > 0:
        grace = min(30.0, settings.timeout / 2)
        timer = threading.Timer(settings.timeout + grace, _stuck, (item, settings, grace))
        timer.daemon = True
        timer.start()
        item.stash[_backstop] = timer
        if _stderr in item.config.stash:
            faulthandler.dump_traceback_later(settings.timeout + 2 * grace, exit=True,
                                              file=item.config.stash[_stderr])
    return result


@pytest.hookimpl(optionalhook=True, wrapper=True)
def pytest_timeout_cancel_timer(item):
    timer = item.stash.get(_backstop, None)
    if timer is not None:
        timer.cancel()
        del item.stash[_backstop]
        faulthandler.cancel_dump_traceback_later()
    return (yield)
