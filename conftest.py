"""pytest's hooks for every test of the repository (the stages' and tests/): the emulated CUDA
device's (workbook/testing/pytest_emulated.py: it loads the device for the tests marked `cuda`, and
counts them in one closing line)."""

pytest_plugins = ["workbook.testing.pytest_emulated"]
