"""Stage 02: the LLTM cell in ATen C++ on the CPU, built ahead of time with setuptools.

The C++ extension (csrc/lltm.cpp) provides `forward` and `backward`; the autograd.Function and
the nn.Module around them are shared by every pybind11 stage and live in
common/workbook/ops/lltm/pybind.py.
"""

from workbook.ops.lltm.pybind import bind

from . import _C

LLTMFunction, lltm, LLTM = bind(_C, name="lltm_cpp")

__all__ = ["LLTMFunction", "lltm", "LLTM"]
