"""The workbook's shared Python: what every stage, test, notebook and tool uses, written once,
in one package per role.

    build/      building the stages and importing them: stage discovery (stage.toml), compiler
                flags, CUDA toolkit, the emulated CUDA device, `python -m workbook.build`
    ops/        everything the workbook knows about each op, one folder per op
                (ops/<op>/: descriptor, float64 reference, bad inputs and matrix rows, fuzz
                strategies, benchmark), and what a descriptor is (ops/spec.py)
    testing/    the shared test base every stage's tests call (testing/__init__.py), the suite
                runner, and the reliability net: hostile-input matrix, fuzzing, concurrency,
                sanitizers
    teaching/   the notebooks' helpers and pictures, and the exercises carved from the stages
    measure/    timing primitives and the benchmark harness (the demo, notebooks, make bench)

No module imports one of a package that imports it back: build/ needs nothing else of the
workbook; ops/ needs build/; testing/, teaching/ and measure/ need ops/ and build/.

Installed in editable mode into the Makefile's .venv (scripts/bootstrap.sh); with PYTHON=, the
Makefile puts common/ on PYTHONPATH.
"""

import logging as _logging


class _NoCudaRuntimeNotice(_logging.Filter):
    """Drops one log record of torch.utils.cpp_extension: "No CUDA runtime is found, using
    CUDA_HOME=...", logged when it is imported (torch.utils.benchmark imports it too) on a machine
    with a CUDA toolkit and no GPU. That is the normal state of a build machine, and of a CPU-only
    learner's; `make doctor` reports the GPUs. Every other message of the module still shows."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return "No CUDA runtime is found" not in record.getMessage()


_logging.getLogger("torch.utils.cpp_extension").addFilter(_NoCudaRuntimeNotice())
