"""Stage 09: extops.ms_deform_attn on the CPU, against float64 references.

The cases, the reference (the grid_sample decomposition) and the bad inputs are the descriptor's
(common/workbook/ops/ms_deform_attn/); the checks are the shared test base's, as for the library's
other ops. Beyond them: the reference against the definition written as loops, the level table's
refusals (the kernels read its values), points outside and NaN, im2col_step and any batch,
reproducibility across runs and thread counts, and the module.
"""

import functools
import sys

import pytest
import torch

from workbook import ops, testing
from workbook.build import stages
from workbook.build.loader import import_stage
from workbook.ops import ms_deform_attn as msda_op
from workbook.ops.ms_deform_attn import reference
from workbook.spec import Sample

SPEC = ops.get("ms_deform_attn")
STAGE = stages.here(__file__)
ALL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def package():
    return import_stage(STAGE)


def ms_deform_attn(*args, **kwargs):
    return package().ms_deform_attn(*args, **kwargs)


# -- against the references, on the shared test base ----------------------------------------------


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], ALL_DTYPES))
def test_against_reference(p):
    testing.assert_against_reference(ms_deform_attn, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], [torch.float64], batch0=False))
def test_gradcheck(p):
    testing.assert_gradcheck(ms_deform_attn, SPEC, p.sample(SPEC),
                             fast_mode=not p.case.full_gradcheck)


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], [torch.float32]))
def test_forward_records_nothing_without_grad(p):
    testing.assert_forward(ms_deform_attn, SPEC, p.sample(SPEC))


def test_forward_mode_and_torch_func_refused_by_name_vmap_works():
    sample = SPEC.make(SPEC.case("b2_q7_m2_d30_l2_p3"), dtype=torch.float64)
    testing.assert_reverse_mode_only(ms_deform_attn, sample, "ms_deform_attn")


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], [torch.bfloat16], batch0=False,
                                             cases=[SPEC.case("b2_q7_m2_d30_l2_p3")]))
def test_runs_inside_autocast_with_mixed_dtypes(p):
    testing.assert_autocast(ms_deform_attn, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("layout", SPEC.layouts)
def test_layouts(layout):
    sample = SPEC.make(SPEC.case("b3_q4_m3_d5_l4_p2"), dtype=torch.float64)
    testing.assert_layout(ms_deform_attn, SPEC, sample, layout)


@pytest.mark.parametrize("name", [None, "value", "sampling_locations", "attention_weights"])
def test_requires_grad_of_one(name):
    sample = SPEC.make(SPEC.case("b2_q7_m2_d30_l2_p3"), dtype=torch.float64)
    testing.assert_requires_grad_of_one(ms_deform_attn, SPEC, sample, name)


@pytest.mark.parametrize(("device", "bad"), testing.bad_input_params(SPEC, ["cpu", "meta"]))
def test_bad_input(device, bad):
    testing.assert_bad_input(ms_deform_attn, bad, device)


@pytest.mark.parametrize("bad", SPEC.bad_inputs("cpu"), ids=str)
def test_bad_input_same_message_from_kernel_and_fake_kernel(bad):
    testing.assert_same_error_everywhere(ms_deform_attn, bad, ["cpu", "meta"])


@pytest.mark.parametrize("bad", msda_op.bad_level_tables("cpu"), ids=str)
def test_level_table_refused_by_the_kernel(bad):
    testing.assert_bad_input(ms_deform_attn, bad, "cpu")


@pytest.mark.parametrize("bad", [b for b in SPEC.bad_inputs("cpu") if b.name in (
    "int16_spatial_shapes", "locations_heads", "weights_points")], ids=str)
def test_bad_input_compiled(bad):
    testing.assert_bad_input_compiled(package().ms_deform_attn, bad, "cpu")


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], [torch.float64]))
def test_opcheck(p, requires_grad):
    package()
    testing.assert_opcheck(torch.ops.extops.ms_deform_attn.default, p.sample(SPEC, requires_grad))


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], [torch.float64], batch0=False))
def test_opcheck_backward(p):
    package()
    sample = p.sample(SPEC, requires_grad=False)
    out = torch.ops.extops.ms_deform_attn(*sample.args)
    args = (torch.randn_like(out), *sample.args, [True, True, True], False)
    testing.assert_opcheck(torch.ops.extops.ms_deform_attn_backward.default,
                           Sample("backward", args), testing.OPCHECK_TESTS[:3])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_matches_eager(dynamic):
    testing.assert_compiled(package().ms_deform_attn, SPEC.make(SPEC.case("b2_q7_m2_d30_l2_p3")),
                            dynamic=dynamic)


def test_meta_inputs_run_the_fake_kernel():
    sample = SPEC.make(msda_op.DETR_SMALL, device="meta", requires_grad=False)
    out = ms_deform_attn(*sample.args)
    assert out.device.type == "meta" and out.shape == (2, 20, 8 * 32)


# -- the reference, the conventions ---------------------------------------------------------------


@pytest.mark.parametrize("case", SPEC.cases[:5], ids=str)
def test_reference_matches_the_definition_written_as_loops(case):
    sample = SPEC.make(case, dtype=torch.float64, requires_grad=False)
    torch.testing.assert_close(sample.call(reference.ms_deform_attn),
                               sample.call(reference.ms_deform_attn_loops), rtol=1e-12,
                               atol=1e-12)


def with_locations(sample: Sample, fill) -> Sample:
    """The sample with fill(locations) applied to a copy of its sampling locations."""
    locations = sample.args[3].detach().clone()
    fill(locations)
    return sample.replaced("sampling_locations", locations.requires_grad_())


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1e30, -2.0, 3.0],
                         ids=["nan", "inf", "-inf", "1e30", "-2", "3"])
def test_points_outside_or_nan_sample_nothing(value):
    """A point outside its level (or at a NaN location) adds nothing to the output and gets zero
    gradients, as in Deformable DETR's kernel: the output equals the output with that point's
    weight set to zero."""
    sample = SPEC.make(SPEC.case("b2_q7_m2_d30_l2_p3"), dtype=torch.float64)
    moved = with_locations(sample, lambda t: t[0, 1, 0, 1, 2].fill_(value))
    weights = sample.args[4].detach().clone()
    weights[0, 1, 0, 1, 2] = 0
    expected = ms_deform_attn(*sample.replaced("attention_weights", weights).args)
    out = ms_deform_attn(*moved.args)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    locations, weights = moved.args[3], moved.args[4]
    g_locations, g_weights = torch.autograd.grad(out.sum(), [locations, weights])
    assert (g_locations[0, 1, 0, 1, 2] == 0).all() and g_weights[0, 1, 0, 1, 2] == 0
    assert torch.isfinite(g_locations).all() and torch.isfinite(g_weights).all()


def test_every_finite_float16_comes_out_as_it_went_in():
    """A point on a pixel's centre with weight 1 copies that pixel's row of value: each of the
    63,488 finite float16 values (subnormals, both zeros and the largest among them), laid out
    as 2048 rows of 32 channels, reaches the output unchanged. The kernels widen float16 to float
    16 channels at a time with integer and float lanes of their own (widen_halves), not c10's
    conversion: this is where a slip in its exponent or its subnormals would show."""
    height, width, channels = 2, 1024, 32
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int16).view(torch.float16)
    value = torch.where(every.isfinite(), every, torch.zeros_like(every))
    value = value.reshape(1, height * width, 1, channels)
    pixel = torch.arange(height * width, dtype=torch.float64)
    centres = torch.stack([(pixel % width + 0.5) / width, (pixel // width + 0.5) / height], -1)
    locations = centres.to(torch.float16).reshape(1, height * width, 1, 1, 1, 2)
    assert torch.equal(locations.double().flatten(), centres.flatten())  # exact in float16
    weights = torch.ones(1, height * width, 1, 1, 1, dtype=torch.float16)
    out = ms_deform_attn(value, torch.tensor([[height, width]]), torch.tensor([0]), locations,
                         weights)
    assert torch.equal(out.reshape(value.shape), value)


def test_empty_batch_queries_and_values():
    base = SPEC.case("b2_q3_m2_d4_empty_level")
    for changes in ({"batch": 0}, {"queries": 0}, {"h0": 0, "h2": 0}):
        sample = SPEC.make(base.with_sizes(**changes))
        call, tensors = sample.bind(ms_deform_attn)
        out = call(*tensors)
        expected = sample.float64().call(reference.ms_deform_attn)
        assert out.shape == expected.shape
        torch.testing.assert_close(out.double(), expected)
        grads = torch.autograd.grad(out.sum(), tensors, allow_unused=True)
        assert all(g is None or g.shape == t.shape for g, t in zip(grads, tensors))


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_im2col_step_is_accepted_and_never_constrains_the_batch(batch):
    sample = SPEC.make(SPEC.case("b1_q5_m1_d8_l1_p1").with_sizes(batch=batch),
                       dtype=torch.float64, requires_grad=False)
    expected = ms_deform_attn(*sample.args)
    for step in (64, 2, 1):  # Deformable DETR's default, a step that does not divide, one
        torch.testing.assert_close(ms_deform_attn(*sample.args, step), expected, rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"ms_deform_attn: `im2col_step` must be an int or None"):
        ms_deform_attn(*sample.args, 2.5)


def test_int32_level_tables_give_the_int64_answer():
    """mmcv builds some level tables as int32: the functional form takes them, bitwise alike."""
    sample = SPEC.make(SPEC.case("b3_q4_m3_d5_l4_p2"), dtype=torch.float64)
    narrow = sample.replaced("spatial_shapes", sample.args[1].int())
    narrow = narrow.replaced("level_start_index", sample.args[2].int())
    for a, b in zip(forward_backward(sample), forward_backward(narrow)):
        assert torch.equal(a, b)


def test_deterministic_mode_gives_the_same_gradients():
    sample = SPEC.make(msda_op.DETR_SMALL)
    plain = forward_backward(sample)
    torch.use_deterministic_algorithms(True)
    try:
        deterministic = forward_backward(sample)
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(plain, deterministic):
        assert torch.equal(a, b)


# -- reproducible: bitwise the same run to run and for any thread count ----------------------------


def forward_backward(sample: Sample) -> list[torch.Tensor]:
    call, tensors = sample.bind(ms_deform_attn)
    out = call(*tensors)
    gen = torch.Generator().manual_seed(3)
    grads = torch.autograd.grad(out, tensors, torch.randn(out.shape, generator=gen,
                                                          dtype=out.dtype))
    return [out.detach(), *grads]


@functools.cache
def reproducibility_sample() -> Sample:
    return SPEC.make(msda_op.case("repro", 3, 40, 4, 24, 3, [(9, 7), (5, 4), (3, 2)]))


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


# -- the module ------------------------------------------------------------------------------------


def reference_module_forward(module, query, reference_points, input_flatten, shapes, starts):
    """MSDeformAttn's forward with the float64 reference op in place of extops'."""
    module_file = sys.modules[type(module).__module__]  # extops/ms_deform_attn.py

    saved = module_file.ms_deform_attn
    module_file.ms_deform_attn = lambda *args: reference.ms_deform_attn(*args)
    try:
        return module(query, reference_points, input_flatten, shapes, starts)
    finally:
        module_file.ms_deform_attn = saved


@pytest.mark.parametrize("corner", [2, 4], ids=["points", "boxes"])
def test_module_matches_the_reference_outputs_and_gradients(corner):
    torch.manual_seed(0)
    attn = package().MSDeformAttn(d_model=32, n_levels=3, n_heads=4, n_points=2).double()
    with torch.no_grad():  # off the paper's start, so the offsets and weights matter
        for p in attn.parameters():
            p.add_(0.1 * torch.randn_like(p))
    shapes, starts = msda_op.level_table([(6, 5), (3, 3), (2, 1)])
    query = torch.randn(2, 7, 32, dtype=torch.float64)
    flat = torch.randn(2, 41, 32, dtype=torch.float64)
    ref = torch.rand(2, 7, 3, corner, dtype=torch.float64)
    out = attn(query, ref, flat, shapes, starts)
    grads = torch.autograd.grad(out.sum(), list(attn.parameters()))
    expected = reference_module_forward(attn, query, ref, flat, shapes, starts)
    expected_grads = torch.autograd.grad(expected.sum(), list(attn.parameters()))
    torch.testing.assert_close(out, expected)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e)


def test_module_parameters_are_deformable_detrs():
    attn = package().MSDeformAttn(d_model=256, n_levels=4, n_heads=8, n_points=4)
    assert {k: tuple(v.shape) for k, v in attn.state_dict().items()} == {
        "sampling_offsets.weight": (256, 256), "sampling_offsets.bias": (256,),
        "attention_weights.weight": (128, 256), "attention_weights.bias": (128,),
        "value_proj.weight": (256, 256), "value_proj.bias": (256,),
        "output_proj.weight": (256, 256), "output_proj.bias": (256,)}


def test_module_takes_deformable_detrs_calls():
    """Deformable DETR's transformer calls _reset_parameters() on every layer, and its code reads
    and sets im2col_step (which changes nothing here)."""
    attn = package().MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=2)
    start = {k: v.clone() for k, v in attn.state_dict().items()}
    assert attn.im2col_step == 64
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(1.0)
    attn._reset_parameters()
    now = attn.state_dict()
    for name in ("sampling_offsets.weight", "sampling_offsets.bias", "attention_weights.weight",
                 "attention_weights.bias", "value_proj.bias", "output_proj.bias"):
        assert torch.equal(now[name], start[name]), name  # the paper's start, no randomness
    bound = (6 / (32 + 32)) ** 0.5  # xavier_uniform's, for the 32 x 32 projections
    for name in ("value_proj.weight", "output_proj.weight"):
        assert now[name].abs().max() <= bound and not torch.equal(now[name], start[name]), name


@pytest.mark.parametrize(("batch", "values"), [(0, 8), (2, 0)], ids=["batch_0", "levels_0x0"])
def test_module_takes_empty_inputs(batch, values):
    attn = package().MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=2)
    shapes, starts = msda_op.level_table([(3, 2), (1, 2)] if values else [(0, 2), (0, 3)])
    query = torch.randn(batch, 5, 32, requires_grad=True)
    out = attn(query, torch.rand(batch, 5, 2, 2), torch.randn(batch, values, 32), shapes, starts)
    assert out.shape == (batch, 5, 32)
    out.sum().backward()
    assert query.grad.shape == query.shape


def test_module_arguments_are_checked():
    with pytest.raises(ValueError, match=r"MSDeformAttn: `d_model` \(30\) must be a multiple of "
                                         r"`n_heads` \(8\)"):
        package().MSDeformAttn(d_model=30)
    with pytest.raises(TypeError, match=r"MSDeformAttn: `n_points` must be an int"):
        package().MSDeformAttn(n_points=4.0)


def test_imports_from_anywhere_without_the_workbook(tmp_path):
    out = testing.assert_imports_alone(
        STAGE, "import torch, extops\n"
               "value = torch.randn(1, 5, 2, 3, requires_grad=True)\n"
               "shapes = torch.tensor([[2, 2], [1, 1]]); starts = torch.tensor([0, 4])\n"
               "loc = torch.rand(1, 4, 2, 2, 3, 2); att = torch.rand(1, 4, 2, 2, 3)\n"
               "out = extops.ms_deform_attn(value, shapes, starts, loc, att)\n"
               "out.sum().backward()\n"
               "print(tuple(out.shape), tuple(value.grad.shape))", tmp_path)
    assert out.split("\n")[-2] == "(1, 4, 6) (1, 5, 2, 3)"
