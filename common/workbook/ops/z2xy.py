"""z = 2x + y (stage 01): the descriptor."""

from __future__ import annotations

import torch

from .. import reference
from ..opspec import BadInput, Case, OpSpec, Sample, other_device

ARG_NAMES = ("x", "y")


def make(case: Case, *, device="cpu", dtype=torch.float32, requires_grad=True, seed=None) -> Sample:
    """x and y of shape (rows, cols), standard normal."""
    rows, cols = case["rows"], case["cols"]
    gen = torch.Generator().manual_seed(rows * 1000 + cols if seed is None else seed)
    x, y = (torch.randn(rows, cols, generator=gen, dtype=torch.float64)
            .to(device=device, dtype=dtype).requires_grad_(requires_grad) for _ in range(2))
    return Sample(case.name, (x, y), arg_names=ARG_NAMES)


def bad_inputs(device: str) -> list[BadInput]:
    """Each builds its inputs on the device make() is given (`elsewhere`: on another one)."""
    def bad(*tensors):
        def build(on):
            return Sample("bad", tuple(t(on) if callable(t) else t for t in tensors),
                          arg_names=ARG_NAMES)
        return build

    def t(*shape, dtype=torch.float32, elsewhere=False):
        return lambda on: torch.ones(*shape, dtype=dtype,
                                     device=other_device(on) if elsewhere else on)

    return [
        BadInput("int64_x", bad(t(3, dtype=torch.int64), t(3)),
                 TypeError, r"`x` must be a floating-point tensor \(Double, Float, Half or "
                 r"BFloat16\), got Long"),
        BadInput("dtype_mismatch", bad(t(3), t(3, dtype=torch.float64)),
                 TypeError, r"`y` must have dtype Float"),
        BadInput("shape_mismatch", bad(t(3, 4), t(4, 3)),
                 ValueError, r"`y` must have the shape of `x`"),
        BadInput("device_mismatch", bad(t(3), t(3, elsewhere=True)),
                 RuntimeError, r"`y` must be on the same device as `x`"),
        BadInput("not_a_tensor", bad(t(3), [1.0, 2.0, 3.0]),
                 TypeError, r"`x` and `y` must be tensors"),
    ]


# -- the hostile-input matrix (workbook/matrix.py)


def matrix_valid(device: str) -> Sample:
    return make(Case("3x4", {"rows": 3, "cols": 4}), device=device, requires_grad=False)


def matrix_extras() -> list:
    from ..matrix import Entry

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
        x, y = matrix_valid(on).args
        return Sample("grad", (x.requires_grad_(), y), arg_names=ARG_NAMES)

    return [
        Entry("x_int32", "dtype", dtypes(torch.int32, torch.float32), TypeError, "x"),
        Entry("x_uint8", "dtype", dtypes(torch.uint8, torch.uint8), TypeError, "x"),
        Entry("x_float8_e4m3fn", "dtype", dtypes(torch.float8_e4m3fn, torch.float8_e4m3fn),
              TypeError, "x"),
        Entry("y_float16", "dtype", dtypes(torch.float32, torch.float16), TypeError, "y"),
        Entry("x_bfloat16_y_float64", "dtype", dtypes(torch.bfloat16, torch.float64), TypeError,
              "y"),
        Entry("both_float16", "dtype", dtypes(torch.float16, torch.float16)),
        Entry("x_on_meta", "device", x_on("meta"), RuntimeError, "x", modes=("eager",)),
        Entry("x_requires_grad_only", "autograd", one_requires_grad),
        Entry("scalars_0d", "empty", pair((), ())),
        Entry("zero_columns", "empty", pair((3, 0), (3, 0))),
        Entry("five_dims", "ndim", pair((2, 1, 3, 1, 2), (2, 1, 3, 1, 2))),
        Entry("y_broadcastable", "shape", pair((3, 4), (4,)), ValueError, "y"),
        Entry("x_3d_y_2d", "ndim", pair((3, 4, 1), (3, 4)), ValueError, "y"),
        Entry("y_transposed_shape", "shape", pair((3, 4), (4, 3)), ValueError, "y"),
    ]


OP = OpSpec(
    name="z2xy",
    arg_names=ARG_NAMES,
    output_names=("z",),
    reference=reference.z2xy,
    make=make,
    cases=(
        Case("n1", {"rows": 1, "cols": 1}),
        Case("3x5", {"rows": 3, "cols": 5}),
        Case("odd_129x7", {"rows": 129, "cols": 7}),
        Case("1823x781", {"rows": 1823, "cols": 781}, full_gradcheck=False),
    ),
    batch_key="rows",
    demo_case=Case("demo", {"rows": 16, "cols": 128}),
    bad_inputs=bad_inputs,
)
