"""extops on PyTorch's stable ABI: one binary for torch 2.10 and later, CPython 3.10 and later.

    import extops

    cell = extops.LLTM(input_features=32, state_size=128)           # the LLTM cell
    new_h, new_cell = cell(x, (h, c))
    out = extops.deform_conv2d(x, offset, weight, bias, padding=1, mask=mask)   # DCNv2
    layer = extops.DeformConv2d(64, 64, 3, padding=1)               # offsets passed in
    block = extops.DCNv2(64, 64, 3, padding=1)                      # predicts its own offsets
    out = extops.ms_deform_attn(value, spatial_shapes, level_start_index,
                                sampling_locations, attention_weights)    # Deformable DETR's
    attn = extops.MSDeformAttn(d_model=256, n_levels=4, n_heads=8, n_points=4)

The same library as stage 09's, the same Python modules (extops/lltm.py, deform_conv2d.py,
errors.py, onnx.py from stage 06, ms_deform_attn.py from stage 09: the build copies them), with
its C++ glue written against torch/csrc/stable instead of ATen: the library links no C++ symbol of
libtorch, only its C shims, which keep their signatures across releases. So one build loads under
every torch from the one it targets (2.10) on, and one abi3 wheel serves every CPython from 3.10
on. What the stable ABI does not offer, autograd and autocast layers in C++, is registered from
Python (extops/python_keys.py; the autograd of the deformable convolution and of multi-scale
deformable attention is Python in their stages already).

Every kernel of the three ops is here, CPU and CUDA (where the build found nvcc): stages 05, 06,
07 and 09's kernel headers, compiled with this stage's glue. It is the production library
`make install` installs. extops.integrations puts multi-scale deformable attention where DETR
models call it: HF transformers (use_extops(model)), Deformable DETR's and mmcv's names.
"""

import torch  # noqa: F401  (loads libtorch, whose C shims the extension library calls)

# Loading _C registers the ops and their kernels; python_keys then adds the autograd and autocast
# layers stage 06 writes in C++, and each op's module its fake kernels and functional form.
# extops.onnx imports onnxscript only when one of its functions is called.
from . import _C, onnx, python_keys  # noqa: F401
from .deform_conv2d import DCNv2, DeformConv2d, deform_conv2d
from .errors import ExtopsTypeError, ExtopsValueError
from .lltm import LLTM, lltm
from .ms_deform_attn import MSDeformAttn, ms_deform_attn

__all__ = ["LLTM", "lltm", "DeformConv2d", "DCNv2", "deform_conv2d", "MSDeformAttn",
           "ms_deform_attn", "ExtopsTypeError", "ExtopsValueError"]
