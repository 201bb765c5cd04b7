"""The hostile-input matrices (workbook/net/matrix.py): every row of every op's table, in every
mode the op supports (eager, meta, compile), each run in a child process, so that a crash fails its
row and the rest still run. One test per row and mode; the tables run once, two at a time, the
first time a test asks for them: those of the tests collected (a test whose result was kept,
workbook.testing.pytest_results, is not).

`python -m workbook.net.matrix --list` prints the tables; `python -m workbook.net.matrix
lltm@5` runs one.
"""

import os

import pytest

from workbook.net import matrix

TARGETS = matrix.targets()  # every op, wherever a stage implements it on the CPU
PARAMS = [pytest.param(target, row, mode, id=f"{target.key}-{row.name}-{mode}")
          for target in TARGETS for row in matrix.table(target.op)
          for mode in matrix.MODES if mode in row.modes and mode in matrix.modes_of(target)]


@pytest.fixture(scope="session")
def results(request):
    wanted = {item.callspec.params["target"].key for item in request.session.items
              if "results" in getattr(item, "fixturenames", ())}
    return matrix.run_all([t for t in TARGETS if t.key in wanted],
                          log=lambda line: print(line, flush=True))


@pytest.mark.parametrize(("target", "row", "mode"), PARAMS)
def test_row(results, target, row, mode):
    result = results[target.key].get((row.name, mode))
    assert result is not None, f"{row.name} [{mode}] never ran"
    assert result.ok, f"{target.key} {row.name} [{mode}]: expected {row.expects()}; " \
                      f"got {result.detail}"


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.key)
def test_every_table_has_at_least_40_rows(target):
    rows = matrix.table(target.op)
    assert len(rows) >= 40, f"{target.key}: {len(rows)} rows"
    kinds = {row.kind for row in rows}
    for kind in ("dtype", "layout", "device", "non-tensor", "view", "subclass", "non-finite",
                 "empty"):
        assert kind in kinds, f"{target.key}: no row of kind {kind!r}"


def test_a_crash_fails_its_row_and_the_rest_still_run(monkeypatch):
    # The child aborts (SIGABRT, as a segfault would end it) on one row; the parent records that
    # row as crashed and starts a new child for the rows after it.
    target = next(t for t in TARGETS if t.key == "z2xy@1")
    rows = matrix.table(target.op)
    victim = rows[3]
    env = dict(os.environ, WORKBOOK_MATRIX_CRASH=f"{victim.name}:eager")
    results = matrix.run_target(target, ("eager",), env=env, log=lambda line: None)
    crashed = results[(victim.name, "eager")]
    assert not crashed.ok and "crashed the process" in crashed.detail, crashed
    after = [results.get((row.name, "eager")) for row in rows[4:] if "eager" in row.modes]
    assert after and all(r is not None and r.ok for r in after), after
