"""Stage 01: z = 2x + y against its reference, on the shared test base."""

import functools

import torch

from workbook import build, reference
from workbook.testing import BadInput, Case, OpTest


@functools.cache
def z2xy():
    return build.import_stage(1)


class TestZ2xy(OpTest):
    cases = [
        Case("n1", {"rows": 1, "cols": 1}),
        Case("3x5", {"rows": 3, "cols": 5}),
        Case("odd_129x7", {"rows": 129, "cols": 7}),
        Case("1823x781", {"rows": 1823, "cols": 781}, full_gradcheck=False),
    ]

    def fn(self, x, y):
        return z2xy().z2xy(x, y)

    def expected_fn(self, x, y):
        return reference.z2xy(x, y)

    def make_inputs(self, case, device, dtype, requires_grad=True):
        gen = torch.Generator().manual_seed(case["rows"] * 1000 + case["cols"])
        shape = (case["rows"], case["cols"])
        return tuple(
            torch.randn(shape, generator=gen, dtype=dtype).to(device).requires_grad_(requires_grad)
            for _ in range(2)
        )

    def bad_inputs(self):
        f32 = torch.float32
        return [
            BadInput("int64_x", lambda: (torch.ones(3, dtype=torch.int64), torch.ones(3)),
                     TypeError, r"`x` must be a floating-point tensor, got Long"),
            BadInput("dtype_mismatch", lambda: (torch.ones(3), torch.ones(3, dtype=torch.float64)),
                     TypeError, r"`y` must have dtype Float"),
            BadInput("shape_mismatch", lambda: (torch.ones(3, 4), torch.ones(4, 3)),
                     ValueError, r"`y` must have the shape of `x`"),
            BadInput("meta_x", lambda: (torch.ones(3, device="meta"), torch.ones(3, device="meta")),
                     RuntimeError, r"`x` must be a CPU tensor, got a tensor on meta"),
            BadInput("device_mismatch", lambda: (torch.ones(3), torch.ones(3, device="meta")),
                     RuntimeError, r"`y` must be on the same device as `x`"),
            BadInput("not_a_tensor", lambda: (torch.ones(3, dtype=f32), [1.0, 2.0, 3.0]),
                     TypeError, r"`x` and `y` must be tensors"),
        ]


def test_module_matches_function():
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    torch.testing.assert_close(z2xy().Z2xy()(x, y), 2 * x + y)
