"""The benchmark: a harness (bench/harness.py) and one module per op (bench/<op>.py).

A package so that its modules import as `bench.harness`, `bench.lltm`: a top-level `lltm` would
shadow stage 05's package of that name. Run it with `python bench/run.py` (see bench/README.md).
"""
