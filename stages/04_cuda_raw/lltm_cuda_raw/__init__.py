"""Stage 04: the LLTM cell with fused CUDA kernels on raw pointers (GEMMs stay in ATen).

The extension (csrc/lltm.cpp, the checks and bindings, and csrc/lltm_cuda.cu, the kernels)
provides `forward` and `backward` with stage 02's interface, for CUDA tensors only; the
autograd.Function and the nn.Module around them are shared with stages 02 and 03 and live in
common/workbook/ops/lltm/pybind.py.
"""

from workbook.ops.lltm.pybind import bind

from . import _C

LLTMFunction, lltm, LLTM = bind(_C, name="lltm_cuda_raw")

__all__ = ["LLTMFunction", "lltm", "LLTM"]
