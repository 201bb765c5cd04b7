"""Property-based fuzzing of the production ops against their float64 references (hypothesis).

For z2xy (stage 01), the LLTM (stage 05's `lltm` and the production library's `extops`) and the
deformable convolution (`extops`), hypothesis draws sizes (0 and 1 included), a dtype, a memory
layout per tensor (contiguous, at a storage offset, a slice of wider rows, every other element,
transposed, expanded with stride 0, channels_last), which inputs require grad, and 1 or 2 CPU
threads; every example's outputs and input gradients must match the reference within the
descriptor's tolerances for the dtype (workbook/fuzz.py says how an example is drawn and
checked).

`make test` runs a short pass (the `ci` counts below, about a minute in all); `make fuzz`
(WORKBOOK_FUZZ=long) the long one, with hypothesis' statistics. The examples are derandomized:
every run draws the same ones, and a failure prints an Example to pass to fuzz.check.
"""

import pytest
from hypothesis import given

from workbook import fuzz, ops, stages
from workbook.fuzz import package

Z2XY = fuzz.any_shape(ops.get("z2xy"))
LLTM = ops.get("lltm")
DEFORM = ops.get("deform_conv2d")


def production():
    return package(stages.production())


def test_every_fuzzed_op_is_in_a_built_stage():
    """The fuzz tests below skip nothing: each op they fuzz imports."""
    assert callable(package(1).z2xy) and callable(package(5).lltm)
    assert callable(production().lltm) and callable(production().deform_conv2d)


@fuzz.settings(ci=300, long=2000)
@given(fuzz.examples(Z2XY, fuzz.z2xy_cases()))
def test_z2xy(example):
    fuzz.check(package(1).z2xy, Z2XY, example)


@fuzz.settings(ci=400, long=5000)
@given(fuzz.examples(LLTM, fuzz.lltm_cases()))
def test_lltm_stage_05(example):
    fuzz.check(package(5).lltm, LLTM, example)


@fuzz.settings(ci=400, long=5000)
@given(fuzz.examples(LLTM, fuzz.lltm_cases()))
def test_lltm_extops(example):
    fuzz.check(production().lltm, LLTM, example)


@fuzz.settings(ci=250, long=2500)
@given(fuzz.examples(DEFORM, fuzz.deform_conv2d_cases()))
def test_deform_conv2d_extops(example):
    fuzz.check(production().deform_conv2d, DEFORM, example)


@pytest.mark.parametrize("layout", sorted(fuzz.STORES))
def test_every_layout_changes_the_storage(layout):
    """Each layout the fuzzer draws stores a tensor as its name says."""
    import torch

    t = torch.arange(24.0).reshape(2, 3, 2, 2)
    stored = fuzz.STORES[layout](t)
    assert stored.shape == t.shape
    if layout != "expanded":
        assert torch.equal(stored, t)
    expected = {"contiguous": t.is_contiguous, "offset": lambda: stored.storage_offset() == 3,
                "sliced": lambda: stored.storage_offset() == 2 and stored.stride()[-2] == 5,
                "strided": lambda: stored.stride()[-1] == 2,
                "permuted": lambda: stored.stride() == (1, 2, 6, 12),
                "expanded": lambda: stored.stride()[0] == 0,
                "channels_last": lambda: stored.is_contiguous(
                    memory_format=torch.channels_last) and not stored.is_contiguous()}
    assert expected[layout]()
