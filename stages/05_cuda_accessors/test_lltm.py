"""Stage 05: the production `lltm` package: torch.library ops with fused CPU and CUDA kernels.

On every machine: the CPU kernels against the float64 reference in all four dtypes, opcheck on
every sample, every bad input also through the fake kernel (meta tensors), torch.compile
(fullgraph=True) against eager, and a package that imports without the workbook. With nvcc the
CUDA kernels must be compiled in; with a GPU they are checked like the CPU ones, against the CPU,
and under CUDA graphs, and at the edges of the launch (empty tensors, state 1, batches past the
row loop's 65535 blocks; opt-in with WORKBOOK_HUGE_TESTS=1, past 2^31 elements in bfloat16).

Stage 06 compiles these kernels into its library, and runs this file there too (its
test_lltm.py): the tests name the library under test by STAGE (its package, the namespace of its
ops), never `lltm` itself.
"""


import pytest
import torch

from workbook import ops, testing
from workbook.build import builder, stages, toolkit
from workbook.build.loader import import_stage
from workbook.ops import lltm as lltm_op
from workbook.spec import Sample

SPEC = ops.get("lltm")
STAGE = stages.here(__file__)
# The devices the stage under test has kernels for: the CPU, and CUDA (a GPU, or the emulated CUDA
# device: workbook.build.emulate) where its stage.toml says `cuda = true`. Stage 10, which runs
# these tests too, has CPU kernels only so far: there the CUDA tests below are not defined.
CUDA_DEVICES = [testing.CUDA] if STAGE.cuda else []
DEVICES = ["cpu", *CUDA_DEVICES]


def package():
    return import_stage(STAGE)


def lltm(*args, **kwargs):
    return package().lltm(*args, **kwargs)


def op(name: str):
    """The dispatcher op `name` of the library under test: torch.ops.<package>.<name>, as each
    library registers its ops under its package's name (lltm here, extops in stage 06, which runs
    these tests too: its test_lltm.py)."""
    package()
    return getattr(getattr(torch.ops, STAGE.package), name)


@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"]) +
                         testing.params(SPEC, CUDA_DEVICES, cases=lltm_op.CUDA_CASES))
def test_against_reference(p):
    testing.assert_against_reference(lltm, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("p", testing.params(SPEC, DEVICES, [torch.float32]))
def test_forward_records_nothing_without_grad(p):
    testing.assert_forward(lltm, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("p", testing.params(SPEC, DEVICES, [torch.float64], batch0=False))
def test_gradcheck(p):
    testing.assert_gradcheck(lltm, SPEC, p.sample(SPEC), fast_mode=not p.case.full_gradcheck)


@pytest.mark.parametrize("layout", ["strided", "permuted", "expanded"])
@pytest.mark.parametrize("device", testing.device_params(DEVICES))
def test_layouts(device, layout):
    testing.assert_layout(lltm, SPEC, SPEC.make(SPEC.case("b5_f17_s33"), device=device), layout)


@pytest.mark.parametrize("name", [None, *lltm_op.ARG_NAMES])
def test_requires_grad_of_one(name):
    testing.assert_requires_grad_of_one(lltm, SPEC, SPEC.make(SPEC.case("b2_f3_s4"),
                                                             dtype=torch.float64), name)


# The same bad inputs on the CPU kernel, on the fake kernel (meta tensors) and on CUDA: the C++
# checks and the fake kernel's must refuse the same inputs with the same message.
@pytest.mark.parametrize(("device", "bad"),
                         testing.bad_input_params(SPEC, ["cpu", "meta", *CUDA_DEVICES]))
def test_bad_input(device, bad):
    testing.assert_bad_input(lltm, bad, device)


@pytest.mark.parametrize("bad", SPEC.bad_inputs("cpu"), ids=str)
def test_bad_input_same_message_from_kernel_and_fake_kernel(bad):
    testing.assert_same_error_everywhere(lltm, bad, ["cpu", "meta"])


# opcheck on every sample the reference tests use (float64: opcheck's own comparisons are exact
# enough there), with and without inputs that require grad.
@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("p", testing.params(SPEC, DEVICES, [torch.float64]))
def test_opcheck_forward(p, requires_grad):
    testing.assert_opcheck(op("lltm_forward").default, p.sample(SPEC, requires_grad))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("p", testing.params(SPEC, DEVICES, [torch.float64]))
def test_opcheck_backward(p, requires_grad):
    sample = lltm_op.backward_sample(p.sample(SPEC), op("lltm_forward"), requires_grad)
    # With inputs that require grad, test_aot_dispatch_dynamic differentiates through the backward
    # op, which raises by design (test_double_backward_raises_clearly): the other three run.
    tests = testing.OPCHECK_TESTS[:3] if requires_grad else testing.OPCHECK_TESTS
    testing.assert_opcheck(op("lltm_backward").default, sample, tests)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_matches_eager(dynamic):
    torch.manual_seed(0)
    model = lltm_op.TwoSteps(package().LLTM)
    inputs = tuple(torch.randn(4, n).requires_grad_() for n in (8, 8, 16, 16))
    testing.assert_compiled(model, Sample("two_steps", inputs), dynamic=dynamic)


def test_meta_inputs_run_the_fake_kernels():
    lltm_op.assert_fake_kernels(op("lltm_forward"), op("lltm_backward"))


# -- the package ----------------------------------------------------------------------------------


def test_cuda_kernels_are_compiled_in_when_nvcc_is_found():
    forward = op("lltm_forward").default.name()  # "<namespace>::lltm_forward"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(forward, "CPU")
    has_cuda_kernels = torch._C._dispatch_has_kernel_for_dispatch_key(forward, "CUDA")
    assert has_cuda_kernels == (not STAGE.cpu_only and toolkit.find() is not None), \
        builder.why_cpu_only(STAGE)


def test_imports_from_anywhere_without_the_workbook(tmp_path):
    name = STAGE.package
    out = testing.assert_imports_alone(STAGE, f"import torch, {name}\n"
                                      f"h, c = {name}.LLTM(3, 4)(torch.zeros(2, 3), "
                                      "(torch.zeros(2, 4), torch.zeros(2, 4)))\n"
                                      "print(tuple(h.shape), tuple(c.shape))", tmp_path)
    assert out.split("\n")[-2] == "(2, 4) (2, 4)"


def test_module_initialises_uniformly_and_runs():
    lltm_op.assert_module(package().LLTM)


def test_not_a_tensor_raises_type_error():
    lltm_op.assert_not_a_tensor_raises(lltm)


def test_gates_output_takes_no_gradient():
    lltm_op.assert_gates_take_no_gradient(op("lltm_forward"))


@pytest.mark.parametrize("used", lltm_op.OP.output_names)
def test_gradient_through_one_output_only(used):
    lltm_op.assert_gradient_through_one_output(lltm, used)


def test_module_checks_its_arguments():
    lltm_op.assert_module_arguments(package().LLTM, f"{STAGE.package}.LLTM")


def test_forward_mode_and_torch_func_refused_by_name_vmap_works():
    testing.assert_reverse_mode_only(lltm, SPEC.make(SPEC.case("b2_f3_s4"), dtype=torch.float64),
                                    "lltm")


# On CUDA the Autocast kernel is registered for the GPU's key (AutocastCUDA) by the C++ front, which
# the emulated device does not build: that case needs a GPU ("cuda", skipped without one).
@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu", "cuda"] if STAGE.cuda else ["cpu"],
                                             [torch.bfloat16],
                                             batch0=False, cases=[SPEC.case("b5_f17_s33")]))
def test_runs_inside_autocast_with_mixed_dtypes(p):
    testing.assert_autocast(lltm, SPEC, p.sample(SPEC))


def test_double_backward_raises_clearly():
    lltm_op.assert_double_backward_raises(lltm)


def test_backward_op_checks_its_inputs():
    lltm_op.assert_backward_op_checks_its_inputs(op("lltm_backward"))


# -- on CUDA: a GPU or the emulated device (a few on a GPU alone) --------------------------------
# (Defined only for a stage with CUDA kernels: its stage.toml says `cuda = true`.)

if STAGE.cuda:
    @testing.requires_cuda
    def test_cuda_matches_cpu():
        testing.assert_cuda_matches_cpu(lltm, SPEC, SPEC.case("b5_f17_s33").with_sizes(state=1029))

    @testing.requires_gpu("CUDA graph capture")
    def test_runs_on_the_current_stream_under_graph_capture():
        testing.assert_graph_capture(lltm, SPEC, lltm_op.CUDA_CASES[-2])

    @testing.requires_gpu("mode=\"reduce-overhead\" (CUDA graphs)")
    def test_compile_reduce_overhead_on_cuda():
        """mode="reduce-overhead" replays the compiled graph as a CUDA graph."""
        torch.manual_seed(0)
        model = lltm_op.TwoSteps(package().LLTM).cuda()
        inputs = [torch.randn(4, n, device="cuda").requires_grad_() for n in (8, 8, 16, 16)]
        testing.assert_compiled(model, Sample("two_steps", tuple(inputs)), calls=2,
                               mode="reduce-overhead")

    @testing.requires_two_gpus
    def test_runs_on_the_inputs_device_not_the_current_one():
        testing.assert_runs_on_inputs_device(lltm, SPEC, SPEC.case("b5_f17_s33"))


# -- edge cases of the launch configuration (issue 14) ---------------------------------------------


# Empty tensors (no launch), state 0 and 1, and batches past 65535 blocks of rows (the row loop);
# the CPU kernel runs the small ones.
@pytest.mark.parametrize("p", testing.params(SPEC, ["cpu"], cases=lltm_op.CPU_EDGE_CASES,
                                             batch0=False) +
                         testing.params(SPEC, CUDA_DEVICES, cases=lltm_op.CUDA_EDGE_CASES,
                                        batch0=False))
def test_edge_cases(p):
    testing.assert_against_reference(lltm, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("p", testing.params(SPEC, DEVICES, [torch.float64],
                                             cases=lltm_op.CPU_EDGE_CASES, batch0=False))
def test_opcheck_edge_cases(p):
    testing.assert_opcheck(op("lltm_forward").default, p.sample(SPEC))
    sample = lltm_op.backward_sample(p.sample(SPEC), op("lltm_forward"), requires_grad=False)
    testing.assert_opcheck(op("lltm_backward").default, sample)


# -- past 2^31 elements: opt-in ------------------------------------------------------------------

HUGE_GIGABYTES = 96  # an estimated peak of 70 GB: see lltm_op.assert_past_2_31_elements


if STAGE.cuda:
    @pytest.mark.skipif(testing.huge_reason(HUGE_GIGABYTES) is not None,
                        reason=testing.huge_reason(HUGE_GIGABYTES) or "")
    def test_past_2_31_elements_in_bfloat16_row_by_row():
        lltm_op.assert_past_2_31_elements(lltm)
