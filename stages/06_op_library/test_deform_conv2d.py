"""Stage 06: extops.deform_conv2d on the CPU, against float64 references and torchvision.

The cases, the reference and the bad inputs are the descriptor's (common/workbook/ops/
deform_conv2d.py); the checks are the shared test base's. Beyond them: the reference itself
against the definition written as loops, torchvision's results, the border and integer-point
conventions, infinite and NaN offsets, reproducibility across runs and thread counts, the
column budget's chunking, and the modules.
"""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from workbook import ops, testing
from workbook.build import stages
from workbook.build.loader import import_stage
from workbook.ops import deform_conv2d as deform_op
from workbook.ops.deform_conv2d import reference
from workbook.spec import Case, OpSpec, Sample, compare

SPEC = ops.get("deform_conv2d")
STAGE = stages.here(__file__)
ALL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def torchvision_ops():
    """torchvision.ops, or a skip of the test that compares with it. Only those tests need it:
    everything against the float64 reference runs without torchvision (beside a torch that no
    torchvision wheel matches, as stage 10's abi check runs it)."""
    return pytest.importorskip("torchvision.ops",
                               reason="torchvision is the comparison baseline of this test: "
                                      "pip install torchvision")


def package():
    return import_stage(STAGE)


def deform_conv2d(*args, **kwargs):
    return package().deform_conv2d(*args, **kwargs)


# -- against the references, on the shared test base ----------------------------------------------


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], ALL_DTYPES))
def test_against_reference(p):
    testing.assert_against_reference(deform_conv2d, SPEC, p.sample(SPEC))


def test_forward_mode_and_torch_func_refused_by_name_vmap_works():
    sample = SPEC.make(SPEC.case("b2_c4_o5_k3_pad1"), dtype=torch.float64)
    testing.assert_reverse_mode_only(deform_conv2d, sample, "deform_conv2d")


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], [torch.bfloat16], batch0=False,
                                             cases=[SPEC.case("b2_c4_o5_k3_pad1")]))
def test_runs_inside_autocast_with_mixed_dtypes(p):
    testing.assert_autocast(deform_conv2d, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], [torch.float32]))
def test_forward_records_nothing_without_grad(p):
    testing.assert_forward(deform_conv2d, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], [torch.float64], batch0=False))
def test_gradcheck(p):
    testing.assert_gradcheck(deform_conv2d, SPEC, p.sample(SPEC),
                            fast_mode=not p.case.full_gradcheck)


@pytest.mark.parametrize("layout", SPEC.layouts)
def test_layouts(layout):
    sample = SPEC.make(SPEC.case("b2_c4_o5_k3_pad1"), dtype=torch.float64)
    testing.assert_layout(deform_conv2d, SPEC, sample, layout)


@pytest.mark.parametrize("name", [None, "input", "offset", "weight", "bias", "mask"])
def test_requires_grad_of_one(name):
    sample = SPEC.make(SPEC.case("torchvision_b1"), dtype=torch.float64)
    testing.assert_requires_grad_of_one(deform_conv2d, SPEC, sample, name)


@pytest.mark.parametrize(("device", "bad"), testing.bad_input_params(SPEC, ["cpu", "meta"]))
def test_bad_input(device, bad):
    testing.assert_bad_input(deform_conv2d, bad, device)


@pytest.mark.parametrize("bad", SPEC.bad_inputs("cpu"), ids=str)
def test_bad_input_same_message_from_kernel_and_fake_kernel(bad):
    testing.assert_same_error_everywhere(deform_conv2d, bad, ["cpu", "meta"])


@pytest.mark.parametrize("bad", [b for b in SPEC.bad_inputs("cpu") if b.name in (
    "offset_channels_not_kernel_multiple", "mask_spatial", "stride_zero", "padding_past_64_bits",
    "offset_on_another_device", "float64_offset", "bias_2d")], ids=str)
def test_bad_input_compiled(bad):
    testing.assert_bad_input_compiled(package().deform_conv2d, bad, "cpu")


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], [torch.float64]))
def test_opcheck(p, requires_grad):
    package()
    testing.assert_opcheck(torch.ops.extops.deform_conv2d.default, p.sample(SPEC, requires_grad))


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], [torch.float64]))
def test_opcheck_backward(p):
    package()
    sample = p.sample(SPEC, requires_grad=False)
    named = dict(sample.named())
    mask, bias = named.get("mask"), named.get("bias")
    out = torch.ops.extops.deform_conv2d(*sample.args, **sample.kwargs)
    grad = torch.randn_like(out)
    args = (grad, named["input"], named["offset"], named["weight"], mask, named["stride"],
            named["padding"], named["dilation"], [True, True, True, bias is not None,
                                                  mask is not None], False)
    # Not test_aot_dispatch_dynamic: no input requires grad, and the op has no derivative.
    testing.assert_opcheck(torch.ops.extops.deform_conv2d_backward.default,
                          Sample("backward", args), testing.OPCHECK_TESTS[:3])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_matches_eager(dynamic):
    testing.assert_compiled(package().deform_conv2d, SPEC.make(SPEC.case("b2_c4_o5_k3_pad1")),
                           dynamic=dynamic)


def test_meta_inputs_run_the_fake_kernel():
    sample = SPEC.make(SPEC.case("torchvision_b33"), device="meta", requires_grad=False)
    out = deform_conv2d(*sample.args, **sample.kwargs)
    assert out.device.type == "meta" and out.shape == (33, 2, *deform_op.out_size(
        SPEC.case("torchvision_b33")))


# -- the references and torchvision ---------------------------------------------------------------


@pytest.mark.parametrize("case", SPEC.cases[:5], ids=str)
def test_reference_matches_the_definition_written_as_loops(case):
    sample = SPEC.make(case, dtype=torch.float64, requires_grad=False)
    torch.testing.assert_close(sample.call(reference.deform_conv2d),
                               sample.call(reference.deform_conv2d_loops), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", SPEC.cases, ids=str)
def test_matches_torchvision(case):
    """Outputs and every gradient against torchvision.ops.deform_conv2d, in float64."""
    compare(deform_conv2d, against(torchvision_ops().deform_conv2d),
            SPEC.make(case, dtype=torch.float64)).assert_ok()


def against(other_reference) -> OpSpec:
    """The descriptor with another implementation as the reference."""
    return dataclasses.replace(SPEC, reference=other_reference)


def test_grid_sample_baseline_matches():
    compare(deform_conv2d, against(reference.deform_conv2d_grid_sample),
            SPEC.make(SPEC.case("b2_c4_o5_k3_pad1"), dtype=torch.float64)).assert_ok()


def test_zero_offsets_and_unit_mask_are_a_convolution():
    case = SPEC.case("b3_c8_o4_g4_og2_k3_s2_d2")
    input, offset, weight, bias = SPEC.make(case, dtype=torch.float64, requires_grad=False).args
    geometry = {"stride": (2, 2), "padding": (2, 2), "dilation": (2, 2)}
    mask = torch.ones(offset.shape[0], offset.shape[1] // 2, *offset.shape[2:],
                      dtype=torch.float64)
    out = deform_conv2d(input, torch.zeros_like(offset), weight, bias, mask=mask, **geometry)
    torch.testing.assert_close(out, F.conv2d(input, weight, bias, groups=4, **geometry))


# -- conventions: integer points, the border, infinities, NaN --------------------------------------


def on_points(dy: float, dx: float, dtype=torch.float64) -> Sample:
    """Every tap of a 3x3 conv (pad 1) over a 4x5 image moved by (dy, dx): integer shifts land
    on pixels, and shifts of about the image's size land on or past the border."""
    case = Case("points", {"batch": 1, "in_channels": 2, "out_channels": 3, "offset_groups": 1,
                           "height": 4, "width": 5, "kernel_h": 3, "kernel_w": 3, "pad_h": 1,
                           "pad_w": 1})
    sample = SPEC.make(case, dtype=dtype)
    offset = torch.empty_like(sample.args[1]).detach()
    offset[:, 0::2], offset[:, 1::2] = dy, dx
    return sample.map(lambda name, t: offset.clone().requires_grad_() if name == "offset" else t)


BORDER_SHIFTS = [(0.0, 0.0), (1.0, -2.0), (0.5, 0.25), (-3.0, 0.0), (-4.0, -5.0), (4.0, 5.0),
                 (-4.0 - 1e-9, 0.0), (3.0 + 1e-9, 4.0 + 1e-9), (-5.0, 1.0), (-1e-12, 1e-12)]


@pytest.mark.parametrize("shift", BORDER_SHIFTS, ids=str)
def test_integer_points_and_border_match_torchvision(shift):
    compare(deform_conv2d, against(torchvision_ops().deform_conv2d), on_points(*shift)).assert_ok()


@pytest.mark.parametrize("value", [float("inf"), -float("inf"), 1e30, -1e30, 2.0**62],
                         ids=["inf", "-inf", "1e30", "-1e30", "2^62"])
def test_offsets_far_outside_give_zero_and_finite_zero_gradients(value):
    sample = on_points(value, 0.5)
    input, offset, weight, bias = sample.args
    out = deform_conv2d(*sample.args, **sample.kwargs)
    # Every sample is outside the image: the output is the bias alone.
    torch.testing.assert_close(out, bias.detach()[None, :, None, None].expand_as(out))
    grads = torch.autograd.grad(out.sum(), [input, offset, sample.kwargs["mask"], weight])
    for name, g in zip(("input", "offset", "mask", "weight"), grads):
        assert torch.isfinite(g).all(), f"gradient of {name} is not finite"
        assert (g == 0).all(), f"gradient of {name} is not zero"


def test_nan_offsets_propagate_nan():
    sample = on_points(0.5, 0.5)
    input, offset, weight, bias = sample.args
    with torch.no_grad():
        offset[0, 0, 1, 2] = float("nan")  # tap 0 of output (1, 2): dy is NaN
    out = deform_conv2d(*sample.args, **sample.kwargs)
    assert out[0, :, 1, 2].isnan().all()
    assert not out[0, :, 0, 0].isnan().any()
    g_offset, g_mask = torch.autograd.grad(out[0, :, 1, 2].sum(), [offset, sample.kwargs["mask"]])
    assert g_offset[0, 0, 1, 2].isnan() and g_offset[0, 1, 1, 2].isnan()
    assert g_mask[0, 0, 1, 2].isnan()


# -- reproducible: bitwise the same run to run and for any thread count ----------------------------


def forward_backward(sample: Sample) -> list[torch.Tensor]:
    call, tensors = sample.bind(deform_conv2d)
    out = call(*tensors)
    gen = torch.Generator().manual_seed(3)
    grads = torch.autograd.grad(out, tensors, torch.randn(out.shape, generator=gen))
    return [out.detach(), *grads]


@functools.cache
def reproducibility_sample() -> Sample:
    return SPEC.make(Case("repro", {"batch": 5, "in_channels": 12, "out_channels": 10,
                                    "groups": 2, "offset_groups": 3, "height": 13, "width": 11,
                                    "kernel_h": 3, "kernel_w": 3, "pad_h": 1, "pad_w": 1}))


@pytest.mark.parametrize("threads", [1, 3])
def test_bitwise_identical_across_runs_and_thread_counts(threads):
    sample = reproducibility_sample()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first, again = forward_backward(sample), forward_backward(sample)
        torch.set_num_threads(threads)
        other = forward_backward(sample)
    finally:
        torch.set_num_threads(before)
    for a, b, c in zip(first, again, other):
        assert torch.equal(a, b), "two runs with 2 threads differ"
        assert torch.equal(a, c), f"2 threads and {threads} differ"


# -- the modules -----------------------------------------------------------------------------------


def test_deform_conv2d_module_matches_torchvision():
    torch.manual_seed(0)
    ours = package().DeformConv2d(6, 4, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1),
                                  groups=2)
    theirs = torchvision_ops().DeformConv2d(6, 4, (3, 2), stride=(2, 1), padding=(1, 0),
                                          dilation=(2, 1), groups=2)
    theirs.load_state_dict(ours.state_dict())
    sample = SPEC.make(SPEC.case("torchvision_b1"), requires_grad=False)
    input, offset, _, _ = sample.args
    mask = sample.kwargs["mask"]
    torch.testing.assert_close(ours(input, offset, mask), theirs(input, offset, mask),
                               rtol=1e-5, atol=1e-5)


def test_dcnv2_block_is_exactly_its_convolution_at_init():
    torch.manual_seed(0)
    block = package().DCNv2(8, 6, 3, stride=2, padding=1, dilation=1, groups=2, offset_groups=4)
    x = torch.randn(3, 8, 11, 9, dtype=torch.float64)
    block = block.double()
    expected = F.conv2d(x, block.weight, block.bias, stride=2, padding=1, groups=2)
    torch.testing.assert_close(block(x), expected, rtol=1e-12, atol=1e-12)
    block(x).sum().backward()
    assert block.offset_mask.weight.grad is not None  # the offsets learn from the first step


def test_module_arguments_are_checked():
    with pytest.raises(ValueError, match=r"DCNv2: `groups` \(3\) must divide in_channels"):
        package().DCNv2(8, 6, 3, groups=3)
    with pytest.raises(TypeError, match=r"DeformConv2d: `in_channels` must be an int"):
        package().DeformConv2d(8.0, 6, 3)
    with pytest.raises(ValueError, match=r"DeformConv2d: `kernel_size` must be positive"):
        package().DeformConv2d(8, 6, 0)


def test_imports_from_anywhere_without_the_workbook(tmp_path):
    out = testing.assert_imports_alone(STAGE, "import torch, extops\n"
                                      "x = torch.randn(1, 4, 6, 6, requires_grad=True)\n"
                                      "y = extops.DCNv2(4, 5, 3, padding=1)(x)\n"
                                      "y.sum().backward()\n"
                                      "print(tuple(y.shape), tuple(x.grad.shape))", tmp_path)
    assert out.split("\n")[-2] == "(1, 5, 6, 6) (1, 4, 6, 6)"
