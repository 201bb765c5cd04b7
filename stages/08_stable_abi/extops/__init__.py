"""extops on PyTorch's stable ABI: one binary for torch 2.10 and later, CPython 3.10 and later.

    import extops

    cell = extops.LLTM(input_features=32, state_size=128)           # the LLTM cell
    new_h, new_cell = cell(x, (h, c))
    new_h, new_cell = extops.lltm(x, weights, bias, h, c)           # the functional form

The same library as stage 06's, the same Python modules (extops/lltm.py, extops/errors.py: the
build copies them from stage 06), with its C++ glue written against torch/csrc/stable instead of
ATen: the library links no C++ symbol of libtorch, only its C shims, which keep their signatures
across releases. So one build loads under every torch from the one it targets (2.10) on, and one
abi3 wheel serves every CPython from 3.10 on. What the stable ABI does not offer, autograd and
autocast layers in C++, is registered from Python (extops/python_keys.py).

This stage holds the LLTM so far (CPU kernels); the deformable convolution and the CUDA kernels
are stage 07's until they move here.
"""

import torch  # noqa: F401  (loads libtorch, whose C shims the extension library calls)

# Loading _C registers the ops and their kernels; python_keys then adds their autograd and
# autocast layers, lltm their fake kernels and functional form.
from . import _C, python_keys  # noqa: F401
from .errors import ExtopsTypeError, ExtopsValueError
from .lltm import LLTM, lltm

__all__ = ["LLTM", "lltm", "ExtopsTypeError", "ExtopsValueError"]
