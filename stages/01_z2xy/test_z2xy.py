"""Stage 01: z = 2x + y against its float64 reference, on the shared test base.

Each test names what it runs over in its parametrize line; the checks themselves live once, in
common/workbook/testing/__init__.py, and the op's inputs, reference and bad inputs in
common/workbook/ops/z2xy/.
"""

import functools

import pytest
import torch

from workbook import ops, testing
from workbook.build import stages
from workbook.build.loader import import_stage

SPEC = ops.get("z2xy")
STAGE = stages.here(__file__)
DTYPES = (torch.float32, torch.float64)


# Built and imported on first use, then kept: import_stage(STAGE) looks over the build's sources
# each time (about a millisecond), which gradcheck, calling the op thousands of times, would pay on
# every call.
@functools.cache
def package():
    return import_stage(STAGE)


def z2xy(*args, **kwargs):
    return package().z2xy(*args, **kwargs)


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], DTYPES))
def test_against_reference(p):
    testing.assert_against_reference(z2xy, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], DTYPES))
def test_forward_records_nothing_without_grad(p):
    testing.assert_forward(z2xy, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], [torch.float64], batch0=False))
def test_gradcheck(p):
    testing.assert_gradcheck(z2xy, SPEC, p.sample(SPEC), fast_mode=not p.case.full_gradcheck)


@pytest.mark.parametrize("layout", ["strided", "permuted", "expanded"])
def test_layouts(layout):
    testing.assert_layout(z2xy, SPEC, SPEC.make(SPEC.case("odd_129x7")), layout)


@pytest.mark.parametrize("name", [None, "x", "y"])
def test_requires_grad_of_one(name):
    testing.assert_requires_grad_of_one(z2xy, SPEC, SPEC.make(SPEC.case("3x5")), name)


@pytest.mark.parametrize(("device", "bad"), testing.bad_input_params(SPEC, ["cpu"]))
def test_bad_input(device, bad):
    testing.assert_bad_input(z2xy, bad, device)


def test_meta_tensors_are_refused():
    # A pybind11 function is no dispatcher op: it has no fake kernel, so meta tensors reach the
    # C++ checks, which accept CPU tensors only.
    x = torch.ones(3, device="meta")
    with pytest.raises(RuntimeError, match=r"`x` must be a cpu tensor, got a tensor on meta"):
        z2xy(x, x)


def test_module_matches_function():
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    torch.testing.assert_close(package().Z2xy()(x, y), 2 * x + y)
