"""lltm: the LLTM recurrent cell as PyTorch custom ops, with fused CPU and CUDA kernels.

    import lltm

    cell = lltm.LLTM(input_features=32, state_size=128)         # an nn.Module
    new_h, new_cell = cell(x, (h, c))
    new_h, new_cell = lltm.lltm(x, weights, bias, h, c)          # the functional form

The ops are torch.ops.lltm.lltm_forward and .lltm_backward (schemas in csrc/lltm.cpp): they
work under autograd, torch.compile(fullgraph=True) and on meta tensors. Built from the workbook's
stage 05; this package needs only torch at run time.
"""

import torch  # noqa: F401  (loads libtorch, which the extension library links against)

from . import _C  # noqa: F401  (loading it registers the ops and their CPU/CUDA kernels)
from .module import LLTM
from .ops import lltm

__all__ = ["LLTM", "lltm"]
