"""Stage 04: fused CUDA kernels on raw pointers, against the float64 reference.

Everywhere nvcc is found, the stage must compile, link and import, and refuse CPU tensors with a
clear error. On a GPU, or without one on the emulated CUDA device (the .cu compiled for the CPU,
every block and thread run), the kernels are checked in every dtype, at state sizes that are not
a multiple of the block size, against the CPU extension of stage 02 (the same C++ front), and at
the edges of the launch: empty tensors (no launch), state 1, batches past 65535 rows. On a GPU
only: CUDA graph capture and, opt-in (WORKBOOK_HUGE_TESTS=1), past 2^31 elements in bfloat16.
Without nvcc every test is skipped with the reason.
"""


import pytest
import torch

from workbook import ops, testing
from workbook.build import builder, stages
from workbook.build.loader import import_stage
from workbook.ops import lltm as lltm_op

SPEC = ops.get("lltm")
STAGE = stages.here(__file__)
CUDA = [testing.CUDA]  # a GPU, or the emulated CUDA device (workbook.build.emulate)


def module():
    try:
        return import_stage(STAGE)
    except builder.StageSkipped as skipped:
        pytest.skip(str(skipped))


def lltm(*args, **kwargs):
    return module().lltm(*args, **kwargs)


@pytest.mark.parametrize("p", testing.params(SPEC, CUDA, cases=lltm_op.CUDA_CASES))
def test_against_reference(p):
    testing.assert_against_reference(lltm, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("p", testing.params(SPEC, CUDA, [torch.float64], batch0=False))
def test_gradcheck(p):
    testing.assert_gradcheck(lltm, SPEC, p.sample(SPEC), fast_mode=not p.case.full_gradcheck)


@testing.requires_cuda
@pytest.mark.parametrize("layout", ["strided", "permuted", "expanded"])
def test_layouts_are_refused(layout):
    # Raw pointers assume dense rows: the front refuses strided inputs, saying what to do.
    sample = SPEC.make(SPEC.case("b5_f17_s33"), device=testing.CUDA)
    testing.assert_layout(lltm, SPEC, sample, layout, refused=r"must be contiguous.*contiguous\(\)")


@pytest.mark.parametrize(("device", "bad"), testing.bad_input_params(SPEC, CUDA))
def test_bad_input(device, bad):
    testing.assert_bad_input(lltm, bad, device)


# -- without a GPU: the stage builds, links and imports ------------------------------------------


def test_imports_with_both_functions():
    m = module()
    assert callable(m._C.forward) and callable(m._C.backward)
    assert issubclass(m.LLTM, torch.nn.Module)
    assert m.__file__.startswith(str(stages.build_root()))


def test_cpu_tensors_are_refused_naming_the_argument():
    inputs = lltm_op.inputs(2, 3, 4, requires_grad=False)
    with pytest.raises(RuntimeError,
                       match=rf"lltm: `input` must be a {testing.CUDA_TYPE_NAME} tensor, "
                             r"got a tensor on cpu"):
        lltm(*inputs)
    new_cell, gates = torch.zeros(2, 4), torch.zeros(2, 12)
    x, w, _, h, _ = inputs
    with pytest.raises(RuntimeError,
                       match=rf"lltm_backward: `grad_h` must be a {testing.CUDA_TYPE_NAME} tensor, "
                             r"got a tensor on cpu"):
        module()._C.backward(new_cell, new_cell, new_cell, gates, x, h, w)


# -- on CUDA: a GPU or the emulated device -------------------------------------------------------


@testing.requires_cuda
def test_matches_the_cpu_extension_of_stage_02():
    testing.assert_cuda_matches_cpu(lltm, SPEC, SPEC.case("b5_f17_s33").with_sizes(state=1029),
                                   cpu_fn=import_stage(stages.get(2)).lltm)


@testing.requires_gpu("CUDA graph capture")
def test_runs_on_the_current_stream_under_graph_capture():
    testing.assert_graph_capture(lltm, SPEC, lltm_op.CUDA_CASES[-2])


@testing.requires_two_gpus
def test_runs_on_the_inputs_device_not_the_current_one():
    testing.assert_runs_on_inputs_device(lltm, SPEC, SPEC.case("b5_f17_s33"))


# -- edge cases of the launch configuration (issue 14) ---------------------------------------------


@pytest.mark.parametrize("p", testing.params(SPEC, CUDA, cases=lltm_op.CUDA_EDGE_CASES,
                                             batch0=False))
def test_edge_cases(p):
    # Empty tensors (no launch), state 0 and 1, and batches past 65535 rows.
    testing.assert_against_reference(lltm, SPEC, p.sample(SPEC))


# -- past 2^31 elements: opt-in ------------------------------------------------------------------

HUGE_GIGABYTES = 96  # an estimated peak of 70 GB: see lltm_op.assert_past_2_31_elements


@pytest.mark.skipif(testing.huge_reason(HUGE_GIGABYTES) is not None,
                    reason=testing.huge_reason(HUGE_GIGABYTES) or "")
def test_past_2_31_elements_in_bfloat16_row_by_row():
    lltm_op.assert_past_2_31_elements(lltm)
