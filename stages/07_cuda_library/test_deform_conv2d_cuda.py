"""Stage 07: extops.deform_conv2d on CUDA, against float64 references, torchvision and the CPU
kernel, in both backward modes.

The cases, the reference and the bad inputs are the descriptor's (common/workbook/ops/
deform_conv2d.py); the checks are the shared test base's. On every machine: the library builds
with its CUDA kernels wherever nvcc is found, imports without the workbook, and its CPU path
(stage 06's kernels) still matches the reference. On a GPU: everything stage 06 tests on the
CPU, on CUDA; where a test runs the backward, in both of its modes (`backward_mode`: the
default, atomic one, and the one torch.use_deterministic_algorithms(True) selects); against the
CPU kernel on inputs large enough to be cut into chunks (of whole images, and of rows of one
image); the deterministic backward bitwise the same over three runs; every bad input, a tensor
left on the CPU included; CUDA graph capture; torch.compile; an input past 2^31 elements (and,
opt-in with WORKBOOK_HUGE_TESTS=1, one in bfloat16 checked image by image in float64).
torchvision, grid_sample and conv2d are compared in the default mode only (their own backward
kernels are not all deterministic), and only the torchvision comparisons need torchvision.
"""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from workbook import ops, testing
from workbook.build import builder, stages, toolkit
from workbook.build.loader import import_stage
from workbook.ops import deform_conv2d as deform_op
from workbook.ops.deform_conv2d import reference
from workbook.spec import BadInput, Case, OpSpec, Sample, assert_rows_close, compare, dtype_name

SPEC = ops.get("deform_conv2d")
STAGE = stages.here(__file__)
CUDA = [testing.CUDA]  # a GPU, or the emulated CUDA device (workbook.build.emulate)
ALL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
MODES = ["atomic", "deterministic"]
# How far two backward passes may differ in gradcheck: atomics add in a different order each
# run (float64 rounding, ~1e-16 relative); the deterministic backward not at all.
NONDET_TOL = {"atomic": 1e-12, "deterministic": 0.0}


def package():
    return import_stage(STAGE)


def deform_conv2d(*args, **kwargs):
    return package().deform_conv2d(*args, **kwargs)


@pytest.fixture(params=MODES)
def backward_mode(request):
    """The backward under test: "atomic" (the default) or "deterministic", which
    torch.use_deterministic_algorithms(True) selects. Restores the setting afterwards."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(request.param == "deterministic")
    try:
        yield request.param
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


# -- on every machine: the build, the package, the CPU path ----------------------------------------


def test_cuda_kernels_are_compiled_in_when_nvcc_is_found():
    package()
    for op in ("extops::deform_conv2d", "extops::deform_conv2d_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")
        has_cuda_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
        assert has_cuda_kernel == (not STAGE.cpu_only and toolkit.find() is not None), \
            builder.why_cpu_only(STAGE)


def test_the_production_library_runs_these_kernels():
    # make install installs the last stage marked production: this one, or one that compiles its
    # kernels (stage 10, the same kernels on the stable ABI), which runs this file's tests too.
    production = stages.production()
    assert production == STAGE or STAGE.folder in production.sources_from, production.label


def test_imports_from_anywhere_without_the_workbook(tmp_path):
    out = testing.assert_imports_alone(STAGE, "import torch, extops\n"
                                      "x = torch.randn(1, 4, 6, 6, requires_grad=True)\n"
                                      "y = extops.DCNv2(4, 5, 3, padding=1)(x)\n"
                                      "y.sum().backward()\n"
                                      "print(tuple(y.shape), tuple(x.grad.shape))", tmp_path)
    assert out.split("\n")[-2] == "(1, 5, 6, 6) (1, 4, 6, 6)"


@pytest.mark.parametrize("p", testing.params(
    SPEC, ["cpu"], [torch.float64, torch.float32],
    cases=[SPEC.case("torchvision_b2_no_mask_no_bias"), SPEC.case("b3_c8_o4_g4_og2_k3_s2_d2")]))
def test_cpu_path_still_matches_the_reference(p):
    testing.assert_against_reference(deform_conv2d, SPEC, p.sample(SPEC))


# -- on CUDA, against the references, on the shared test base --------------------------------------


@pytest.mark.parametrize("p", testing.params(SPEC, CUDA, ALL_DTYPES))
def test_against_reference(p, backward_mode):
    testing.assert_against_reference(deform_conv2d, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("p", testing.params(SPEC, CUDA, [torch.float32]))
def test_forward_records_nothing_without_grad(p):
    testing.assert_forward(deform_conv2d, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("p", testing.params(SPEC, CUDA, [torch.float64], batch0=False))
def test_gradcheck(p, backward_mode):
    testing.assert_gradcheck(deform_conv2d, SPEC, p.sample(SPEC),
                            fast_mode=not p.case.full_gradcheck,
                            nondet_tol=NONDET_TOL[backward_mode])


@testing.requires_cuda
@pytest.mark.parametrize("layout", SPEC.layouts)
def test_layouts(layout):
    testing.assert_layout(deform_conv2d, SPEC, cuda_sample("b2_c4_o5_k3_pad1"), layout)


@testing.requires_cuda
@pytest.mark.parametrize("name", [None, "input", "offset", "weight", "bias", "mask"])
def test_requires_grad_of_one(name, backward_mode):
    testing.assert_requires_grad_of_one(deform_conv2d, SPEC, cuda_sample("torchvision_b1"), name)


def cuda_sample(case: str, dtype=torch.float64) -> Sample:
    return SPEC.make(SPEC.case(case), device=testing.CUDA, dtype=dtype)


# -- bad inputs: refused before anything is launched ----------------------------------------------


@pytest.mark.parametrize(("device", "bad"), testing.bad_input_params(SPEC, CUDA))
def test_bad_input(device, bad):
    testing.assert_bad_input(deform_conv2d, bad, device)


def left_on_the_cpu(name: str) -> BadInput:
    """A valid CUDA sample with one tensor left on the CPU: torchvision's kernel launches with the
    CPU pointer and the GPU faults (an illegal memory access, which poisons the process); ours
    must refuse it first. With the input on the CPU, the dispatcher still picks the CUDA kernel
    (the other tensors are CUDA tensors), and the first tensor that differs is named."""
    def make(device):
        sample = SPEC.make(SPEC.case("torchvision_b1"), device=device, requires_grad=False)
        return sample.map(lambda arg, t: t.cpu() if arg == name else t)

    wrong, first = ("offset", "input") if name == "input" else (name, "input")
    return BadInput(f"{name}_on_the_cpu", make, RuntimeError,
                    rf"deform_conv2d: `{wrong}` must be on the same device as `{first}`")


@testing.requires_cuda
@pytest.mark.parametrize("name", ["input", "offset", "weight", "bias", "mask"])
def test_a_tensor_left_on_the_cpu_is_refused(name):
    testing.assert_bad_input(deform_conv2d, left_on_the_cpu(name), testing.CUDA)


def check_backward_op_refuses_a_tensor_on_the_cpu(name: str) -> None:
    """deform_conv2d_backward called directly (it is public) with one tensor on the CPU."""
    case = SPEC.case("torchvision_b1")
    named = dict(SPEC.make(case, device=testing.CUDA, requires_grad=False).named())
    grad_output = torch.ones(1, 2, *deform_op.out_size(case), device=testing.CUDA)
    args = {"grad_output": grad_output, "input": named["input"],
            "offset": named["offset"], "weight": named["weight"], "mask": named["mask"]}
    args[name] = args[name].cpu()
    wrong, first = ("input", "grad_output") if name == "grad_output" else (name, "grad_output")
    with pytest.raises(RuntimeError, match=rf"deform_conv2d_backward: `{wrong}` must be on the "
                                           rf"same device as `{first}`"):
        torch.ops.extops.deform_conv2d_backward(*args.values(), named["stride"], named["padding"],
                                                named["dilation"], [True] * 5, False)


@testing.requires_cuda
@pytest.mark.parametrize("name", ["grad_output", "input", "offset", "weight", "mask"])
def test_backward_op_refuses_a_tensor_on_the_cpu(name):
    check_backward_op_refuses_a_tensor_on_the_cpu(name)


@testing.requires_cuda
@pytest.mark.parametrize("bad", SPEC.bad_inputs("cpu"), ids=str)
def test_bad_input_same_message_from_cuda_kernel_and_fake_kernel(bad):
    testing.assert_same_error_everywhere(deform_conv2d, bad, [testing.CUDA, "meta"])


@testing.requires_cuda
@pytest.mark.parametrize("bad", [b for b in SPEC.bad_inputs("cpu") if b.name in (
    "offset_channels_not_kernel_multiple", "mask_spatial", "stride_zero", "padding_past_64_bits",
    "offset_on_another_device", "float64_offset", "bias_2d")], ids=str)
def test_bad_input_compiled(bad):
    testing.assert_bad_input_compiled(package().deform_conv2d, bad, testing.CUDA)


# -- opcheck and torch.compile ---------------------------------------------------------------------


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("p", testing.params(SPEC, CUDA, [torch.float64]))
def test_opcheck(p, requires_grad):
    package()
    testing.assert_opcheck(torch.ops.extops.deform_conv2d.default, p.sample(SPEC, requires_grad))


def backward_sample(sample: Sample, deterministic: bool) -> Sample:
    """The arguments of deform_conv2d_backward for a forward sample, every output wanted."""
    named = dict(sample.named())
    mask, bias = named.get("mask"), named.get("bias")
    out = torch.ops.extops.deform_conv2d(*sample.args, **sample.kwargs)
    return Sample("backward", (torch.randn_like(out), named["input"], named["offset"],
                               named["weight"], mask, named["stride"], named["padding"],
                               named["dilation"], [True, True, True, bias is not None,
                                                   mask is not None], deterministic))


@pytest.mark.parametrize("p", testing.params(SPEC, CUDA, [torch.float64]))
def test_opcheck_backward(p, backward_mode):
    package()
    # Not test_aot_dispatch_dynamic: no input requires grad, and the op has no derivative.
    testing.assert_opcheck(torch.ops.extops.deform_conv2d_backward.default,
                          backward_sample(p.sample(SPEC, requires_grad=False),
                                          backward_mode == "deterministic"),
                          testing.OPCHECK_TESTS[:3])


@testing.requires_cuda
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_matches_eager(dynamic):
    testing.assert_compiled(package().deform_conv2d, cuda_sample("b2_c4_o5_k3_pad1", torch.float32),
                           dynamic=dynamic)


@testing.requires_gpu("mode=\"reduce-overhead\" (CUDA graphs)")
def test_compile_reduce_overhead_replays_a_cuda_graph():
    testing.assert_compiled(package().deform_conv2d, cuda_sample("b2_c4_o5_k3_pad1", torch.float32),
                           calls=2, mode="reduce-overhead")


@testing.requires_gpu("CUDA graph capture")
def test_runs_on_the_current_stream_under_graph_capture(backward_mode):
    testing.assert_graph_capture(deform_conv2d, SPEC, SPEC.case("b2_c16_o16_16x16_k3"))


@testing.requires_two_gpus
def test_runs_on_the_inputs_device_not_the_current_one():
    testing.assert_runs_on_inputs_device(deform_conv2d, SPEC, SPEC.case("b2_c16_o16_16x16_k3"))


# -- against torchvision and the plain PyTorch baselines (default mode) ----------------------------


def torchvision_ops():
    """torchvision.ops, or a skip of the one test that compares with it: the GPU tests must not
    depend on torchvision being installed where they run."""
    return pytest.importorskip("torchvision.ops",
                               reason="torchvision is the comparison baseline: pip install "
                               "torchvision")


def against(other_reference) -> OpSpec:
    """The descriptor with another implementation as the reference."""
    return dataclasses.replace(SPEC, reference=other_reference)


@testing.requires_cuda
@pytest.mark.parametrize("case", SPEC.cases, ids=str)
def test_matches_torchvision(case):
    compare(deform_conv2d, against(torchvision_ops().deform_conv2d),
            SPEC.make(case, device=testing.CUDA, dtype=torch.float64)).assert_ok()


@testing.requires_cuda
def test_grid_sample_baseline_matches():
    compare(deform_conv2d, against(reference.deform_conv2d_grid_sample),
            cuda_sample("b2_c4_o5_k3_pad1")).assert_ok()


def check_zero_offsets_and_unit_mask_are_a_convolution() -> None:
    input, offset, weight, bias = cuda_sample("b3_c8_o4_g4_og2_k3_s2_d2").detached().args
    geometry = {"stride": (2, 2), "padding": (2, 2), "dilation": (2, 2)}
    mask = torch.ones(offset.shape[0], offset.shape[1] // 2, *offset.shape[2:], dtype=offset.dtype,
                      device=offset.device)
    out = deform_conv2d(input, torch.zeros_like(offset), weight, bias, mask=mask, **geometry)
    torch.testing.assert_close(out, F.conv2d(input, weight, bias, groups=4, **geometry))


@testing.requires_cuda
def test_zero_offsets_and_unit_mask_are_a_convolution():
    check_zero_offsets_and_unit_mask_are_a_convolution()


# -- conventions: integer points, the border, infinities, NaN --------------------------------------


def on_points(dy: float, dx: float, device=testing.CUDA) -> Sample:
    """Every tap of a 3x3 conv (pad 1) over a 4x5 image moved by (dy, dx): integer shifts land
    on pixels, and shifts of about the image's size land on or past the border."""
    case = Case("points", {"batch": 1, "in_channels": 2, "out_channels": 3, "offset_groups": 1,
                           "height": 4, "width": 5, "kernel_h": 3, "kernel_w": 3, "pad_h": 1,
                           "pad_w": 1})
    sample = SPEC.make(case, device=device, dtype=torch.float64)
    offset = torch.empty_like(sample.args[1]).detach()
    offset[:, 0::2], offset[:, 1::2] = dy, dx
    return sample.map(lambda name, t: offset.clone().requires_grad_() if name == "offset" else t)


BORDER_SHIFTS = [(0.0, 0.0), (1.0, -2.0), (0.5, 0.25), (-3.0, 0.0), (-4.0, -5.0), (4.0, 5.0),
                 (-4.0 - 1e-9, 0.0), (3.0 + 1e-9, 4.0 + 1e-9), (-5.0, 1.0), (-1e-12, 1e-12)]


@testing.requires_cuda
@pytest.mark.parametrize("shift", BORDER_SHIFTS, ids=str)
def test_integer_points_and_border_match_torchvision(shift):
    compare(deform_conv2d, against(torchvision_ops().deform_conv2d), on_points(*shift)).assert_ok()


@testing.requires_cuda
@pytest.mark.parametrize("shift", BORDER_SHIFTS, ids=str)
def test_integer_points_and_border_match_the_cpu_kernel(shift, backward_mode):
    check_matches_cpu_kernel(on_points(*shift, device="cpu"))


def check_far_outside(value: float) -> None:
    sample = on_points(value, 0.5)
    input, offset, weight, bias = sample.args
    out = deform_conv2d(*sample.args, **sample.kwargs)
    # Every sample is outside the image: the output is the bias alone.
    torch.testing.assert_close(out, bias.detach()[None, :, None, None].expand_as(out))
    grads = torch.autograd.grad(out.sum(), [input, offset, sample.kwargs["mask"], weight])
    for name, g in zip(("input", "offset", "mask", "weight"), grads):
        assert torch.isfinite(g).all(), f"gradient of {name} is not finite"
        assert (g == 0).all(), f"gradient of {name} is not zero"


@testing.requires_cuda
@pytest.mark.parametrize("value", [float("inf"), -float("inf"), 1e30, -1e30, 2.0**62],
                         ids=["inf", "-inf", "1e30", "-1e30", "2^62"])
def test_offsets_far_outside_give_zero_and_finite_zero_gradients(value, backward_mode):
    check_far_outside(value)


def check_nan_propagates() -> None:
    sample = on_points(0.5, 0.5)
    input, offset, weight, bias = sample.args
    with torch.no_grad():
        offset[0, 0, 1, 2] = float("nan")  # tap 0 of output (1, 2): dy is NaN
    out = deform_conv2d(*sample.args, **sample.kwargs)
    assert out[0, :, 1, 2].isnan().all()
    assert not out[0, :, 0, 0].isnan().any()
    g_input, g_offset, g_mask = torch.autograd.grad(out[0, :, 1, 2].sum(),
                                                    [input, offset, sample.kwargs["mask"]])
    assert g_offset[0, 0, 1, 2].isnan() and g_offset[0, 1, 1, 2].isnan()
    assert g_mask[0, 0, 1, 2].isnan()
    assert not g_input.isnan().any(), "a NaN sample has no pixel to scatter into"


@testing.requires_cuda
def test_nan_offsets_propagate_nan(backward_mode):
    check_nan_propagates()


# -- against the CPU kernel: chunks, batches, both backward modes ----------------------------------


def forward_backward(sample: Sample) -> list[torch.Tensor]:
    """The output and the gradient of every differentiable input, for one fixed random incoming
    gradient (drawn on the CPU, so the CPU and the GPU get the same one)."""
    call, tensors = sample.bind(deform_conv2d)
    out = call(*tensors)
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(out.shape, generator=gen, dtype=out.dtype).to(out.device)
    return [out.detach(), *torch.autograd.grad(out, tensors, grad)]


def check_matches_cpu_kernel(cpu: Sample, rtol: float = 1e-10, atol: float = 1e-10) -> None:
    """The CUDA kernels against stage 06's CPU kernel on the same values (float64: tight)."""
    cuda = cpu.map(lambda _, t: t.detach().to(testing.CUDA).requires_grad_(t.requires_grad))
    names = ["output"] + [f"gradient of {name}" for name, _ in cpu.differentiable()]
    for name, a, e in zip(names, forward_backward(cuda), forward_backward(cpu)):
        torch.testing.assert_close(a.cpu(), e, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# One image over the column budget (256 MiB) in the backward: chunks of output rows; and a batch
# cut into chunks of whole images (3 or 4 in the backward, 2 in the forward).
ROW_CHUNKS = Case("b2_c64_o32_176x176_k3", {"batch": 2, "in_channels": 64, "out_channels": 32,
                                            "offset_groups": 2, "height": 176, "width": 176,
                                            "kernel_h": 3, "kernel_w": 3, "pad_h": 1, "pad_w": 1})
IMAGE_CHUNKS = Case("b12_c32_o16_96x96_k3", {"batch": 12, "in_channels": 32, "out_channels": 16,
                                             "groups": 2, "offset_groups": 4, "height": 96,
                                             "width": 96, "kernel_h": 3, "kernel_w": 3,
                                             "pad_h": 1, "pad_w": 1})


@testing.requires_cuda
@pytest.mark.parametrize("case", [ROW_CHUNKS, IMAGE_CHUNKS], ids=str)
def test_big_inputs_match_the_cpu_kernel(case, backward_mode):
    check_matches_cpu_kernel(SPEC.make(case, dtype=torch.float64))


@testing.requires_cuda
@pytest.mark.parametrize("batch", [0, 40])
def test_batch_0_and_over_32_match_the_cpu_kernel(batch, backward_mode):
    check_matches_cpu_kernel(SPEC.make(deform_op.torchvision_case(f"torchvision_b{batch}", batch),
                                       dtype=torch.float64))


@testing.requires_cuda
def test_float32_matches_the_cpu_kernel(backward_mode):
    testing.assert_cuda_matches_cpu(deform_conv2d, SPEC, SPEC.case("b2_c16_o16_16x16_k3"))


# -- reproducible: the deterministic backward, bitwise, run to run ---------------------------------


@functools.cache
def overlapping_case() -> Case:
    """Many corners on every pixel (3 x 3 taps, small offsets, two offset groups), so that an
    atomic scatter would add them in a different order each run."""
    return Case("repro", {"batch": 4, "in_channels": 32, "out_channels": 24, "groups": 2,
                          "offset_groups": 2, "height": 23, "width": 19, "kernel_h": 3,
                          "kernel_w": 3, "pad_h": 1, "pad_w": 1, "offset_scale": 1})


def check_bitwise_reproducible(dtype: torch.dtype) -> None:
    sample = SPEC.make(overlapping_case(), device=testing.CUDA, dtype=dtype)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [forward_backward(sample) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(before)
    names = ["output"] + [f"gradient of {name}" for name, _ in sample.differentiable()]
    for name, first, *others in zip(names, *runs):
        for k, other in enumerate(others, 2):
            assert torch.equal(first, other), f"{name}: run {k} differs from run 1"


@testing.requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16], ids=dtype_name)
def test_deterministic_backward_is_bitwise_reproducible(dtype):
    check_bitwise_reproducible(dtype)


# -- an input past 2^31 elements -------------------------------------------------------------------


def gpu_gigabytes() -> float:
    return torch.cuda.get_device_properties(0).total_memory / 1e9 if testing.NO_GPU is None else 0


requires_40_gb = pytest.mark.skipif(testing.NO_GPU is not None or gpu_gigabytes() < 40,
                                    reason=f"needs a GPU with >= 40 GB ({testing.NO_GPU}): the "
                                    "emulated device does not hold tensors past 2^31 elements")


def check_input_past_2_31_elements() -> None:
    """input [1, 3, 27000, 27000] (2.19e9 elements, float16): a 1 x 1 identity convolution with
    stride 2 and zero offsets copies every other pixel, exactly. Channel 2 starts at element
    1.46e9, so its last rows lie past 2^31: a 32-bit index would wrap there. The backward
    scatters grad_output back into those pixels, exactly, and nothing into the others."""
    side = 27000
    input = torch.randn(1, 3, side, side, device="cuda", dtype=torch.float16, requires_grad=True)
    assert input.numel() > 2**31 and 2 * side * side + (side - 200) * side > 2**31
    offset = torch.zeros(1, 2, side // 2, side // 2, device="cuda", dtype=torch.float16)
    weight = torch.eye(3, device="cuda", dtype=torch.float16).view(3, 3, 1, 1)
    out = deform_conv2d(input, offset, weight, stride=2)
    assert torch.equal(out[0, 2, -100:], input.detach()[0, 2, -200::2, ::2])
    grad = torch.randn_like(out)
    (grad_input,) = torch.autograd.grad(out, input, grad)
    assert torch.equal(grad_input[0, 2, -200::2, ::2], grad[0, 2, -100:])
    assert not grad_input[0, 2, -199::2].any() and not grad_input[0, 2, -200:, 1::2].any()


@requires_40_gb
def test_input_past_2_31_elements(backward_mode):
    check_input_past_2_31_elements()


# -- past 2^31 elements in bfloat16, checked image by image: opt-in --------------------------------

# 65600 images of 32 x 32 x 32: the input has 2^31 + 2.1M elements, its last 64 images lie past
# 2^31, and every kernel runs its 64-bit index path. 3 x 3, stride 2, two offset groups, a mask.
HUGE_CASE = Case("b65600_c32_o8_32x32_k3_s2_og2", {
    "batch": 65536 + 64, "in_channels": 32, "out_channels": 8, "offset_groups": 2, "height": 32,
    "width": 32, "kernel_h": 3, "kernel_w": 3, "stride_h": 2, "stride_w": 2, "pad_h": 1,
    "pad_w": 1}, full_gradcheck=False)
HUGE_GIGABYTES = 40  # an estimated peak of 25 GB: see check_past_2_31_elements_bfloat16


def check_past_2_31_elements_bfloat16(fn, case=HUGE_CASE, device="cuda", images=512) -> None:
    """fn forward and backward once in bfloat16 on `case`, drawn on the device as the
    descriptor's make() draws (offsets between pixel lines, mask in [0, 1)), then the output and
    every gradient against the float64 reference, `images` images at a time (a float64 copy of
    the whole would not fit); the weight's and bias' gradients, sums over the batch, are summed
    chunk by chunk in float64. Peak on the GPU: the input and its gradient (4.3 GB each, plus a
    float32 accumulator of 8.6 GB), offsets, mask and their gradients (3.6 GB), the column
    buffers (under 1 GB): about 25 GB."""
    s = case.sizes
    n, c, o, g = s["batch"], s["in_channels"], s["out_channels"], s["offset_groups"]
    taps = g * s["kernel_h"] * s["kernel_w"]
    out_h, out_w = deform_op.out_size(case)
    gen = torch.Generator(device=device).manual_seed(0)

    def uniform(*shape, low=-1.0, high=1.0, between_pixels=False):
        t = torch.empty(shape, device=device).uniform_(low, high, generator=gen)
        if between_pixels:  # fractional part in [0.1, 0.9], as make() keeps it
            t = t.floor() + 0.1 + 0.8 * (t - t.floor())
        return t.to(torch.bfloat16).requires_grad_()

    bound = (c * s["kernel_h"] * s["kernel_w"]) ** -0.5
    input = uniform(n, c, s["height"], s["width"])
    assert input.numel() > 2**31
    offset = uniform(n, 2 * taps, out_h, out_w, low=-2.5, high=2.5, between_pixels=True)
    weight = uniform(o, c, s["kernel_h"], s["kernel_w"], low=-bound, high=bound)
    bias = uniform(o, low=-bound, high=bound)
    mask = uniform(n, taps, out_h, out_w, low=0.0)
    geometry = {"stride": (s["stride_h"], s["stride_w"]), "padding": (s["pad_h"], s["pad_w"])}
    out = fn(input, offset, weight, bias, mask=mask, **geometry)
    grad = torch.empty_like(out).uniform_(-1, 1, generator=gen)
    grads = torch.autograd.grad(out, (input, offset, weight, bias, mask), grad)
    out = out.detach()
    tolerance = SPEC.tolerance(torch.bfloat16)
    weight64, bias64 = (t.detach().double().requires_grad_() for t in (weight, bias))
    sums = [torch.zeros_like(weight64), torch.zeros_like(bias64)]
    for start in range(0, n, images):
        part = slice(start, min(start + images, n))
        x, off, m = (t.detach()[part].double().requires_grad_() for t in (input, offset, mask))
        expected = SPEC.reference(x, off, weight64, bias64, mask=m, **geometry)
        expected_grads = torch.autograd.grad(expected, (x, off, weight64, bias64, m),
                                             grad[part].double())
        for what, actual, wanted in (("output", out[part], expected),
                                     ("gradient of input", grads[0][part], expected_grads[0]),
                                     ("gradient of offset", grads[1][part], expected_grads[1]),
                                     ("gradient of mask", grads[4][part], expected_grads[4])):
            assert_rows_close(what, part, actual, wanted.detach(), tolerance)
        sums[0] += expected_grads[2]
        sums[1] += expected_grads[3]
    everything = slice(0, n)
    assert_rows_close("gradient of weight", everything, grads[2], sums[0], tolerance)
    assert_rows_close("gradient of bias", everything, grads[3], sums[1], tolerance)


@pytest.mark.skipif(testing.huge_reason(HUGE_GIGABYTES) is not None,
                    reason=testing.huge_reason(HUGE_GIGABYTES) or "")
def test_past_2_31_elements_in_bfloat16_image_by_image(backward_mode):
    check_past_2_31_elements_bfloat16(deform_conv2d)


# -- the modules -----------------------------------------------------------------------------------


def check_dcnv2_block_is_its_convolution_at_init() -> None:
    torch.manual_seed(0)
    block = package().DCNv2(8, 6, 3, stride=2, padding=1, groups=2, offset_groups=4)
    block = block.double().to(testing.CUDA)
    x = torch.randn(3, 8, 11, 9, dtype=torch.float64, device=testing.CUDA)
    expected = F.conv2d(x, block.weight, block.bias, stride=2, padding=1, groups=2)
    torch.testing.assert_close(block(x), expected, rtol=1e-12, atol=1e-12)
    block(x).sum().backward()
    assert block.offset_mask.weight.grad is not None  # the offsets learn from the first step


@testing.requires_cuda
def test_dcnv2_block_is_exactly_its_convolution_at_init():
    check_dcnv2_block_is_its_convolution_at_init()
