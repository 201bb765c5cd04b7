"""Stage 02: the LLTM cell in ATen C++ (setuptools build) against the float64 reference."""

import functools
import math

import pytest
import torch
from lltm_base import LLTMOpTest, lltm_inputs

from workbook import build


@functools.cache
def lltm_cpp():
    return build.import_stage(2)


class TestLLTMCpp(LLTMOpTest):
    def fn(self, *inputs):
        return lltm_cpp().lltm(*inputs)


def test_module_initialises_uniformly_and_runs():
    torch.manual_seed(0)
    cell = lltm_cpp().LLTM(input_features=32, state_size=128)
    bound = 1 / math.sqrt(128)
    for p in (cell.weights, cell.bias):
        assert p.abs().max() <= bound
        assert p.abs().max() > 0.9 * bound  # spread over the range, not all zeros
    x, _, _, h, c = lltm_inputs(16, 32, 128, requires_grad=False)
    new_h, new_c = cell(x, (h, c))
    assert new_h.shape == new_c.shape == (16, 128)
    (new_h.sum() + new_c.sum()).backward()
    assert cell.weights.grad is not None and cell.bias.grad is not None


def test_module_rejects_empty_sizes():
    with pytest.raises(ValueError, match="state_size must be >= 1"):
        lltm_cpp().LLTM(input_features=3, state_size=0)


def test_not_a_tensor_raises_type_error():
    x, w, b, h, c = lltm_inputs(2, 3, 4, requires_grad=False)
    with pytest.raises(TypeError, match="`old_h` must be a tensor, got list"):
        lltm_cpp().lltm(x, w, b, [[0.0] * 4] * 2, c)
