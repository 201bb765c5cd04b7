"""The test that is running, kept in a file: a process that dies inside a test (a signal: a write
out of bounds, a corrupted heap's abort) leaves the test's name behind for whoever started it.

    WORKBOOK_RUNNING=/tmp/running.txt pytest -p workbook.teaching.pytest_running ...

The file holds the node id of the test that started last, and is emptied when it ends. `make
verify` reads it when pytest dies of a signal (workbook.teaching.exercises), to say which test
crashed. pytest's own faulthandler prints the Python stack at that moment; this gives the name
alone, in a form a command can take back.
"""

from __future__ import annotations

import os

ENV = "WORKBOOK_RUNNING"


def _write(text: str) -> None:
    path = os.environ.get(ENV)
    if path:
        with open(path, "w") as f:  # closed at once: what a signal finds is on disk
            f.write(text)


def pytest_runtest_logstart(nodeid, location):
    _write(nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _write("")


def running(path) -> str | None:
    """The test that was running when the process that kept `path` stopped, or None."""
    try:
        return open(path).read().strip() or None
    except FileNotFoundError:
        return None
