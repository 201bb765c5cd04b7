"""z2xy's rows of the hostile-input matrix (workbook.net.matrix), beyond the generic rows
every op gets and the bad inputs of its descriptor: dtype pairs, devices, 0-d and 5-d shapes.
"""

from __future__ import annotations

import torch

from workbook.ops.z2xy import ARG_NAMES, make
from workbook.spec import Case, Row, Sample


def valid(device: str) -> Sample:
    """The valid sample every generic row starts from (float32, no grad)."""
    return make(Case("3x4", {"rows": 3, "cols": 4}), device=device, requires_grad=False)


def rows() -> list[Row]:
    """The rows of this op beyond the generic ones and the bad inputs."""

    def pair(x_shape, y_shape):
        return lambda on: Sample("shapes", (torch.ones(x_shape, device=on),
                                            torch.ones(y_shape, device=on)), arg_names=ARG_NAMES)

    def dtypes(x_dtype, y_dtype):
        return lambda on: Sample("dtypes", (torch.ones(3, device=on, dtype=x_dtype),
                                            torch.ones(3, device=on, dtype=y_dtype)),
                                 arg_names=ARG_NAMES)

    def x_on(device):
        return lambda on: Sample("devices", (torch.ones(3, device=device),
                                             torch.ones(3, device=on)), arg_names=ARG_NAMES)

    def one_requires_grad(on):
        x, y = valid(on).args
        return Sample("grad", (x.requires_grad_(), y), arg_names=ARG_NAMES)

    return [
        Row("x_int32", "dtype", dtypes(torch.int32, torch.float32), TypeError, "x"),
        Row("x_uint8", "dtype", dtypes(torch.uint8, torch.uint8), TypeError, "x"),
        Row("x_float8_e4m3fn", "dtype", dtypes(torch.float8_e4m3fn, torch.float8_e4m3fn),
              TypeError, "x"),
        Row("y_float16", "dtype", dtypes(torch.float32, torch.float16), TypeError, "y"),
        Row("x_bfloat16_y_float64", "dtype", dtypes(torch.bfloat16, torch.float64), TypeError,
              "y"),
        Row("both_float16", "dtype", dtypes(torch.float16, torch.float16)),
        Row("x_on_meta", "device", x_on("meta"), RuntimeError, "x", modes=("eager",)),
        Row("x_requires_grad_only", "autograd", one_requires_grad),
        Row("scalars_0d", "empty", pair((), ())),
        Row("zero_columns", "empty", pair((3, 0), (3, 0))),
        Row("five_dims", "ndim", pair((2, 1, 3, 1, 2), (2, 1, 3, 1, 2))),
        Row("y_broadcastable", "shape", pair((3, 4), (4,)), ValueError, "y"),
        Row("x_3d_y_2d", "ndim", pair((3, 4, 1), (3, 4)), ValueError, "y"),
        Row("y_transposed_shape", "shape", pair((3, 4), (4, 3)), ValueError, "y"),
    ]
