"""The workbook's shared Python: what every stage, test, notebook and tool uses, written once.

    stages      the stages, found on disk (stages/NN_name/stage.toml)
    build       building and importing a stage: build folder, flags, C++11 ABI, MAX_JOBS
    toolkit     finding (or installing from pip) a CUDA toolkit that matches torch
    ops         one descriptor per op (ops/lltm.py, ops/deform_conv2d.py, ...)
    opspec      what a descriptor is (OpSpec, Case, Sample, BadInput) and the one comparison
                with the float64 reference (compare)
    reference   plain PyTorch versions of every op: the references and the eager baselines
    testing     the shared test base: the checks every stage's tests call
    suite       the test runner: a pytest process per stage and for tests/, side by side
    matrix      hostile-input tables per op, each row run eager, on meta and compiled, in a
                child process (tests/test_matrix.py)
    fuzz        hypothesis strategies for the ops' inputs (tests/test_fuzz.py, make fuzz)
    sanitize    the stages built with ASan+UBSan and tested on it (make sanitize)
    exercises   exercises carved from the stages' sources: list, carve, check, reveal
    lltm        the autograd.Function and nn.Module of the pybind11 LLTM stages (02-04)
    timing      timing primitives (torch.utils.benchmark medians, IQR)
    notebook    the notebooks' helpers (source excerpts, commands, tables, sweeps, plots)
    pictures    the notebooks' pictures, each checked against real tensors before it is drawn

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
