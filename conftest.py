"""pytest's hooks for every test of the repository (the stages' and tests/): the emulated CUDA
device's (workbook/testing/pytest_emulated.py: it loads the device for the tests marked `cuda`, and
counts them in one closing line), and the run log's
(workbook/testing/pytest_timings.py: each test's time, where WORKBOOK_RUNLOG names a log); and the
fail-fast ones (workbook/testing/pytest_failfast.py: a failed dtype skips its case's other dtypes,
a stuck test is named); and the kept results' (workbook/testing/pytest_results.py: where
WORKBOOK_RESULTS names a folder, a test that passed on the same inputs is not run again)."""

pytest_plugins = ["workbook.testing.pytest_emulated", "workbook.testing.pytest_timings",
                  "workbook.testing.pytest_failfast", "workbook.testing.pytest_results"]
