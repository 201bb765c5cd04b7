"""Stage 04: fused CUDA kernels on raw pointers, against the float64 reference.

Everywhere nvcc is found, the stage must compile, link and import, and refuse CPU tensors with a
clear error. With a GPU, the kernels are also checked in every dtype, at state sizes that are not
a multiple of the block size, against the CPU extension of stage 02, and under CUDA graph capture.
Without nvcc the whole file is skipped with the reason.
"""

import functools

import pytest
import torch
from lltm_base import LLTMOpTest, lltm_inputs
from lltm_cuda_base import (CUDA_CASES, CUDA_DTYPES, REDUCED_PRECISION_TOLERANCES,
                            assert_cuda_matches_cpu, assert_runs_on_the_inputs_device,
                            bad_inputs_without_cuda, capture_and_replay, requires_cuda)

from workbook import build
from workbook.testing import BadInput


@functools.cache
def _import():
    return build.import_stage(4)


def lltm_cuda_raw():
    try:
        return _import()
    except build.StageSkipped as skipped:
        pytest.skip(str(skipped))


class TestLLTMCudaRaw(LLTMOpTest):
    cases = CUDA_CASES
    devices = ("cuda",)
    accepts_noncontiguous = False  # raw pointers assume dense rows: strided inputs are refused
    bad_input_device = "cuda"

    def dtypes(self, device):
        return CUDA_DTYPES

    def tolerances(self, dtype):
        return REDUCED_PRECISION_TOLERANCES.get(dtype) or super().tolerances(dtype)

    def fn(self, *inputs):
        return lltm_cuda_raw().lltm(*inputs)

    def bad_inputs(self):
        if not torch.cuda.is_available():
            return bad_inputs_without_cuda()
        x, w, b, h, c = lltm_inputs(2, 3, 4, device="cuda", requires_grad=False)
        return [
            *super().bad_inputs(),
            BadInput("weights_on_cpu", lambda: (x, w.cpu(), b, h, c),
                     RuntimeError, r"`weights` must be a CUDA tensor, got a tensor on cpu"),
        ]


# -- without a GPU: the stage builds, links and imports ------------------------------------------


def test_imports_with_both_functions():
    module = lltm_cuda_raw()
    assert callable(module._C.forward) and callable(module._C.backward)
    assert issubclass(module.LLTM, torch.nn.Module)
    assert module.__file__.startswith(str(build.build_root()))


def test_cpu_tensors_are_refused_naming_the_argument():
    inputs = lltm_inputs(2, 3, 4, requires_grad=False)
    with pytest.raises(RuntimeError,
                       match=r"lltm: `input` must be a CUDA tensor, got a tensor on cpu"):
        lltm_cuda_raw().lltm(*inputs)
    new_cell, gates = torch.zeros(2, 4), torch.zeros(2, 12)
    x, w, _, h, _ = inputs
    with pytest.raises(RuntimeError,
                       match=r"lltm_backward: `grad_h` must be a CUDA tensor, got a tensor on cpu"):
        lltm_cuda_raw()._C.backward(new_cell, new_cell, new_cell, gates, x, h, w)


# -- with a GPU -----------------------------------------------------------------------------------


@requires_cuda
def test_matches_the_cpu_extension():
    assert_cuda_matches_cpu(build.import_stage(2).lltm, lltm_cuda_raw().lltm)


@requires_cuda
def test_runs_on_the_current_stream_under_graph_capture():
    inputs = lltm_inputs(4, 8, 1025, device="cuda")
    replayed, eager = capture_and_replay(lltm_cuda_raw().lltm, inputs)
    for a, b in zip(replayed, eager):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_runs_on_the_inputs_device_not_the_current_one():
    assert_runs_on_the_inputs_device(lltm_cuda_raw().lltm)
