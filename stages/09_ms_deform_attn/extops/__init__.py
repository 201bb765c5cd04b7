"""extops: custom PyTorch ops with CPU and CUDA kernels, one library, now with three ops.

    import extops

    cell = extops.LLTM(input_features=32, state_size=128)           # the LLTM cell
    out = extops.deform_conv2d(x, offset, weight, bias, padding=1, mask=mask)   # DCNv2
    out = extops.ms_deform_attn(value, spatial_shapes, level_start_index,
                                sampling_locations, attention_weights)    # Deformable DETR's
    attn = extops.MSDeformAttn(d_model=256, n_levels=4, n_heads=8, n_points=4)

Stage 06's library (its modules: extops/lltm.py, deform_conv2d.py, errors.py, onnx.py, copied
into the build by setup.py) plus stage 07's CUDA kernels and this stage's op, multi-scale
deformable attention (extops/ms_deform_attn.py, csrc/ms_deform_attn/). The package needs only
torch at run time.
"""

import torch  # noqa: F401  (loads libtorch, which the extension library links against)

# Loading _C registers every op and its CPU/CUDA kernels.
from . import _C, onnx  # noqa: F401
from .deform_conv2d import DCNv2, DeformConv2d, deform_conv2d
from .errors import ExtopsTypeError, ExtopsValueError
from .lltm import LLTM, lltm
from .ms_deform_attn import MSDeformAttn, ms_deform_attn

__all__ = ["LLTM", "lltm", "DeformConv2d", "DCNv2", "deform_conv2d", "MSDeformAttn",
           "ms_deform_attn", "ExtopsTypeError", "ExtopsValueError"]
