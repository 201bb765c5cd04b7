"""The workbook's shared Python: what every stage, test, notebook and tool uses, written once,
in one package per role.

    spec.py     what the workbook knows of any op: a descriptor (OpSpec), its cases and calls
                (Case, Sample), the inputs it refuses (BadInput, matrix Row), and the one
                comparison with the float64 reference (compare)
    build/      building the stages and importing them: stage discovery (stage.toml), compiler
                flags, CUDA toolkit, the emulated CUDA device, `python -m workbook.build`
    measure/    timing primitives and the benchmark harness (the demo, notebooks, make bench)
    testing/    the shared test base every stage's tests call (testing/__init__.py), the suite
                runner and its pytest plugin
    ops/        everything the workbook knows about each op, one folder per op (ops/<op>/:
                descriptor, float64 reference, matrix rows, fuzz strategy, benchmark), and where
                each is implemented (ops.implementations)
    net/        the reliability net beyond each stage's tests: hostile-input matrix, fuzzing,
                sanitizers
    teaching/   the notebooks' helpers and pictures, and the exercises carved from the stages

Listed from the ground up: a package imports only those above it in this list (build/ and
spec.py nothing else of the workbook; an op's bench.py the harness of measure/), so no two
import each other.

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
