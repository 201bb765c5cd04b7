"""Stage 02: the LLTM cell in ATen C++ (setuptools build) against the float64 reference.

The sizes, the reference and the bad inputs are the LLTM descriptor's (common/workbook/ops/lltm/),
shared by every LLTM stage; the checks are the shared test base's
(common/workbook/testing/__init__.py).
"""

import functools

import pytest
import torch

from workbook import ops, testing
from workbook.build import stages
from workbook.build.loader import import_stage
from workbook.ops import lltm as lltm_op

SPEC = ops.get("lltm")
STAGE = stages.here(__file__)
DTYPES = (torch.float32, torch.float64)


@functools.cache  # imported on first use, then kept: gradcheck calls the op thousands of times
def package():
    return import_stage(STAGE)


def lltm(*args, **kwargs):
    return package().lltm(*args, **kwargs)


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], DTYPES))
def test_against_reference(p):
    testing.assert_against_reference(lltm, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], [torch.float32]))
def test_forward_records_nothing_without_grad(p):
    testing.assert_forward(lltm, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], [torch.float64], batch0=False))
def test_gradcheck(p):
    testing.assert_gradcheck(lltm, SPEC, p.sample(SPEC), fast_mode=not p.case.full_gradcheck)


@pytest.mark.parametrize("layout", ["strided", "permuted", "expanded"])
def test_layouts(layout):
    testing.assert_layout(lltm, SPEC, SPEC.make(SPEC.case("b5_f17_s33")), layout)


@pytest.mark.parametrize("name", [None, *lltm_op.ARG_NAMES])
def test_requires_grad_of_one(name):
    testing.assert_requires_grad_of_one(lltm, SPEC, SPEC.make(SPEC.case("b2_f3_s4"),
                                                             dtype=torch.float64), name)


@pytest.mark.parametrize(("device", "bad"), testing.bad_input_params(SPEC, ["cpu"]))
def test_bad_input(device, bad):
    testing.assert_bad_input(lltm, bad, device)


def test_meta_tensors_are_refused():
    inputs = lltm_op.inputs(2, 3, 4, device="meta", requires_grad=False)
    with pytest.raises(RuntimeError, match=r"`input` must be a cpu tensor, got a tensor on meta"):
        lltm(*inputs)


def test_not_a_tensor_raises_type_error():
    x, w, b, h, c = lltm_op.inputs(2, 3, 4, requires_grad=False)
    with pytest.raises(TypeError, match="`old_h` must be a tensor, got list"):
        lltm(x, w, b, [[0.0] * 4] * 2, c)


def test_module_initialises_uniformly_and_runs():
    lltm_op.assert_module(package().LLTM)


def test_module_rejects_empty_sizes():
    with pytest.raises(ValueError, match="state_size must be >= 1"):
        package().LLTM(input_features=3, state_size=0)
