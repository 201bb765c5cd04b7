"""Stage 09: extops.ms_deform_attn on CUDA, against float64 references and the CPU kernel, in both
backward modes.

On a GPU, or without one on the emulated CUDA device (the stage's own .cu and .cuh compiled for
the CPU, every thread run, the warp sums by shuffles): the float64 reference in every dtype, in
the default (atomic) backward and the deterministic one (torch.use_deterministic_algorithms);
gradcheck; the CPU kernel on Deformable DETR's head configuration; bitwise the same gradients over
runs in deterministic mode; the bad inputs and the level table's refusals, on CUDA tensors.
"""

import pytest
import torch

from workbook import ops, testing
from workbook.build import builder, stages, toolkit
from workbook.build.loader import import_stage
from workbook.ops import ms_deform_attn as msda_op
from workbook.spec import Sample

SPEC = ops.get("ms_deform_attn")
STAGE = stages.here(__file__)
CUDA = [testing.CUDA]  # a GPU, or the emulated CUDA device (workbook.build.emulate)
ALL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
MODES = ["atomic", "deterministic"]
NONDET_TOL = {"atomic": 1e-12, "deterministic": 0.0}


def package():
    return import_stage(STAGE)


def ms_deform_attn(*args, **kwargs):
    return package().ms_deform_attn(*args, **kwargs)


@pytest.fixture(params=MODES)
def backward_mode(request):
    """"atomic" (the default backward) or "deterministic" (torch.use_deterministic_algorithms);
    restores the setting afterwards."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(request.param == "deterministic")
    try:
        yield request.param
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def test_cuda_kernels_are_compiled_in_when_nvcc_is_found():
    package()
    for op in ("extops::ms_deform_attn", "extops::ms_deform_attn_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")
        has_cuda_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
        assert has_cuda_kernel == (not STAGE.cpu_only and toolkit.find() is not None), \
            builder.why_cpu_only(STAGE)


@pytest.mark.parametrize("p", testing.params(SPEC, CUDA, ALL_DTYPES))
def test_against_reference(p, backward_mode):
    testing.assert_against_reference(ms_deform_attn, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("p", testing.params(SPEC, CUDA, [torch.float64], batch0=False))
def test_gradcheck(p, backward_mode):
    testing.assert_gradcheck(ms_deform_attn, SPEC, p.sample(SPEC),
                             fast_mode=not p.case.full_gradcheck,
                             nondet_tol=NONDET_TOL[backward_mode])


@pytest.mark.parametrize(("device", "bad"), testing.bad_input_params(SPEC, CUDA))
def test_bad_input(device, bad):
    testing.assert_bad_input(ms_deform_attn, bad, device)


@testing.requires_cuda
@pytest.mark.parametrize("bad", msda_op.bad_level_tables("cpu"), ids=str)
def test_level_table_refused_by_the_kernel(bad):
    testing.assert_bad_input(ms_deform_attn, bad, testing.CUDA)


@testing.requires_cuda
@pytest.mark.parametrize("mode", MODES)
def test_float32_matches_the_cpu_kernel(mode):
    sample = SPEC.make(msda_op.DETR_SMALL)
    cpu = forward_backward(sample)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(mode == "deterministic")
    try:
        cuda = forward_backward(sample.map(lambda _, t: t.detach().to(testing.CUDA)
                                           .requires_grad_(t.requires_grad)))
    finally:
        torch.use_deterministic_algorithms(before)
    for name, a, b in zip(("out", "value", "sampling_locations", "attention_weights"), cpu, cuda):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")


@testing.requires_cuda
def test_deterministic_backward_is_bitwise_the_same_over_runs():
    sample = SPEC.make(msda_op.DETR_SMALL, device=testing.CUDA)
    torch.use_deterministic_algorithms(True)
    try:
        runs = [forward_backward(sample) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(False)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@testing.requires_cuda
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -2.0], ids=["nan", "inf", "-2"])
def test_points_outside_or_nan_sample_nothing(value, backward_mode):
    sample = SPEC.make(SPEC.case("b2_q7_m2_d30_l2_p3"), device=testing.CUDA, dtype=torch.float64)
    locations = sample.args[3].detach().clone()
    locations[0, 1, 0, 1, 2] = value
    weights = sample.args[4].detach().clone()
    weights[0, 1, 0, 1, 2] = 0
    expected = ms_deform_attn(*sample.replaced("attention_weights", weights).args)
    moved = sample.replaced("sampling_locations", locations.requires_grad_())
    out = ms_deform_attn(*moved.args)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    g_locations, g_weights = torch.autograd.grad(out.sum(), [moved.args[3], moved.args[4]])
    assert (g_locations[0, 1, 0, 1, 2] == 0).all() and g_weights[0, 1, 0, 1, 2] == 0


def forward_backward(sample: Sample) -> list[torch.Tensor]:
    call, tensors = sample.bind(ms_deform_attn)
    out = call(*tensors)
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(out.shape, generator=gen, dtype=out.dtype).to(out.device)
    return [out.detach(), *torch.autograd.grad(out, tensors, grad)]
