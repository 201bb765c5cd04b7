"""z = 2x + y (stage 01): the descriptor."""

from __future__ import annotations

import torch

from workbook.ops.z2xy import reference
from workbook.spec import BadInput, Case, OpSpec, Sample, other_device

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
                 TypeError, r"`x` must be a float64, float32, float16 or bfloat16 tensor, got "
                 r"torch.int64"),
        BadInput("dtype_mismatch", bad(t(3), t(3, dtype=torch.float64)),
                 TypeError, r"`y` must have dtype torch.float32 \(the dtype of `x`\), got "
                 r"torch.float64"),
        BadInput("shape_mismatch", bad(t(3, 4), t(4, 3)),
                 ValueError, r"`y` must have the shape of `x`"),
        BadInput("device_mismatch", bad(t(3), t(3, elsewhere=True)),
                 RuntimeError, r"`y` must be on the same device as `x`"),
        BadInput("not_a_tensor", bad(t(3), [1.0, 2.0, 3.0]),
                 TypeError, r"`x` and `y` must be tensors"),
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
    # Threads calling it at once (tests/test_concurrency.py): large enough that calls overlap.
    concurrency_case=Case("129x70", {"rows": 129, "cols": 70}),
    bad_inputs=bad_inputs,
)
