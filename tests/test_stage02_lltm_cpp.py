"""Stage 02: the LLTM cell in ATen C++ (setuptools build) against the float64 reference."""

import functools

import pytest
from lltm_base import LLTMOpTest, check_module_initialises_uniformly_and_runs, lltm_inputs

from workbook import build


@functools.cache
def lltm_cpp():
    return build.import_stage(2)


class TestLLTMCpp(LLTMOpTest):
    def fn(self, *inputs):
        return lltm_cpp().lltm(*inputs)


def test_module_initialises_uniformly_and_runs():
    check_module_initialises_uniformly_and_runs(lltm_cpp().LLTM)


def test_module_rejects_empty_sizes():
    with pytest.raises(ValueError, match="state_size must be >= 1"):
        lltm_cpp().LLTM(input_features=3, state_size=0)


def test_not_a_tensor_raises_type_error():
    x, w, b, h, c = lltm_inputs(2, 3, 4, requires_grad=False)
    with pytest.raises(TypeError, match="`old_h` must be a tensor, got list"):
        lltm_cpp().lltm(x, w, b, [[0.0] * 4] * 2, c)
