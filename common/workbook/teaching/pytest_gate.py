"""A pytest that starts before what it tests is built, and waits at a gate to collect it.

    WORKBOOK_GATE=/tmp/gate pytest -p workbook.teaching.pytest_gate ...

The process loads as usual (the interpreter, pytest, its plugins, torch: seconds), then, before
collecting, waits until the file named by WORKBOOK_GATE says `go`; anything else written there
(the build failed) ends the session at once, with nothing collected and nothing run. `make verify`
(workbook.teaching.exercises) starts its tests this way while the learner's copy compiles: the
compiler keeps one core busy, and torch's import, which would otherwise follow the build, is
done on the other by the time the library is ready. The test modules, which import the built
stage, are imported only after `go`.

If whoever started the process goes away before opening the gate, the process stops waiting.

At the other end, once the report and the JUnit file are written, the process leaves at once,
with pytest's exit status: the interpreter's teardown, with torch and its compiler stack loaded,
takes a second, all of it after the verdict. Not under a preloaded sanitizer runtime, whose own
exit hooks decide the status.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path

import pytest

ENV = "WORKBOOK_GATE"
GO = "go"

_status = pytest.StashKey[int]()


def pytest_configure(config):
    # Loaded early on purpose: the import this gate exists to overlap with the build.
    import torch  # noqa: F401


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session):
    path = os.environ.get(ENV)
    if not path:
        return None
    gate, parent = Path(path), os.getppid()
    while not gate.is_file() or not gate.read_text().strip():
        if os.getppid() != parent:
            pytest.exit(f"{ENV}: the process that started this run is gone", returncode=3)
        time.sleep(0.02)
    word = gate.read_text().strip()
    if word != GO:
        pytest.exit(f"{ENV}: {word}", returncode=3)
    return None


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_status] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if not os.environ.get(ENV) or "LD_PRELOAD" in os.environ or _status not in config.stash:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)  # what C++ wrote through stdio, too
    os._exit(config.stash[_status])


def open_gate(path: Path, word: str = GO) -> None:
    """Say `word` at the gate: `go`, or why not (written whole, then moved into place, so the
    waiting process never reads half of it)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(word + "\n")
    partial.replace(path)
