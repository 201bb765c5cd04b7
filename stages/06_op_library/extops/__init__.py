"""extops: custom PyTorch ops with CPU and CUDA kernels, one library.

    import extops

    cell = extops.LLTM(input_features=32, state_size=128)           # the LLTM cell
    new_h, new_cell = cell(x, (h, c))
    out = extops.deform_conv2d(x, offset, weight, bias, padding=1, mask=mask)   # DCNv2
    layer = extops.DeformConv2d(64, 64, 3, padding=1)               # offsets passed in
    block = extops.DCNv2(64, 64, 3, padding=1)                      # predicts its own offsets

The ops are torch.ops.extops.* (schemas in csrc/<op>/<op>.cpp): they work under autograd,
torch.compile(fullgraph=True) and on meta tensors. One Python module per op (extops/lltm.py,
extops/deform_conv2d.py) holds its fake kernel, autograd formula, functional form and modules.
Bad input raises ExtopsValueError / ExtopsTypeError, which derive from ValueError / TypeError
and from RuntimeError (what torchvision raises): `except RuntimeError` catches them too
(extops/errors.py). Deploy: torch.jit.script takes the functional forms and the modules (legacy:
prefer torch.export), torch.export and AOTInductor take the ops, and extops.onnx exports
deform_conv2d to ONNX DeformConv.
Built from the workbook's stage 06 (CPU kernels for deform_conv2d) or stage 07 (CUDA ones too,
the production build); the package needs only torch at run time.
"""

import torch  # noqa: F401  (loads libtorch, which the extension library links against)

# Loading _C registers every op and its CPU/CUDA kernels; extops.onnx imports onnxscript only
# when one of its functions is called.
from . import _C, onnx  # noqa: F401
from .deform_conv2d import DCNv2, DeformConv2d, deform_conv2d
from .errors import ExtopsTypeError, ExtopsValueError
from .lltm import LLTM, lltm

__all__ = ["LLTM", "lltm", "DeformConv2d", "DCNv2", "deform_conv2d", "ExtopsTypeError",
           "ExtopsValueError"]
