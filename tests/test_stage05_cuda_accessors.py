"""Stage 05: the production `lltm` package: torch.library ops with fused CPU and CUDA kernels.

On every machine: the CPU kernels against the float64 reference (all four dtypes), torch.library's
opcheck on both ops, meta tensors through the fake kernels, torch.compile(fullgraph=True) against
eager, and a package that imports without the workbook. With nvcc the CUDA kernels must also be
compiled in; with a GPU they are checked like the CPU ones, against the CPU, and under CUDA graphs.
"""

import functools
import os
import subprocess
import sys

import pytest
import torch
from lltm_base import LLTMOpTest, check_module_initialises_uniformly_and_runs, lltm_inputs
from lltm_cuda_base import (CUDA_CASES, CUDA_DTYPES, REDUCED_PRECISION_TOLERANCES,
                            assert_cuda_matches_cpu, assert_runs_on_the_inputs_device,
                            bad_inputs_without_cuda, capture_and_replay, requires_cuda)

from workbook import build, reference, toolkit
from workbook.testing import BadInput


@functools.cache
def lltm():
    return build.import_stage(5)


def meta_bad_inputs(bad_inputs, device):
    """The shared bad inputs, adjusted to the dispatcher: a meta tensor among the inputs sends the
    call to the fake kernel (Meta outranks CPU and CUDA), which refuses the mix of devices, and
    all-meta inputs are no error at all (see test_meta_inputs_run_the_fake_kernel)."""
    adjusted = []
    for bad in bad_inputs:
        if bad.name == "meta_weights":
            bad = BadInput(bad.name, bad.make, RuntimeError,
                           rf"lltm: `weights` must be on the same device as `input` "
                           rf"\({device}(:0)?\), got meta")
        if bad.name != "all_on_meta":
            adjusted.append(bad)
    return adjusted


class TestLLTMCPU(LLTMOpTest):
    devices = ("cpu",)

    def dtypes(self, device):
        return CUDA_DTYPES  # the CPU kernel dispatches over the same four

    def tolerances(self, dtype):
        return REDUCED_PRECISION_TOLERANCES.get(dtype) or super().tolerances(dtype)

    def fn(self, *inputs):
        return lltm().lltm(*inputs)

    def bad_inputs(self):
        return meta_bad_inputs(super().bad_inputs(), "cpu")


class TestLLTMCUDA(TestLLTMCPU):
    cases = CUDA_CASES
    devices = ("cuda",)
    bad_input_device = "cuda"

    def bad_inputs(self):
        if not torch.cuda.is_available():
            return bad_inputs_without_cuda()
        return meta_bad_inputs(LLTMOpTest.bad_inputs(self), "cuda")


# -- the package ----------------------------------------------------------------------------------


def test_cuda_kernels_are_compiled_in_when_nvcc_is_found():
    lltm()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("lltm::forward", "CPU")
    has_cuda_kernels = torch._C._dispatch_has_kernel_for_dispatch_key("lltm::forward", "CUDA")
    assert has_cuda_kernels == (toolkit.find() is not None), toolkit.reason()


IMPORT_ALONE = """
import sys, torch, lltm
assert "workbook" not in sys.modules, "lltm imported the workbook"
h, c = lltm.LLTM(3, 4)(torch.zeros(2, 3), (torch.zeros(2, 4), torch.zeros(2, 4)))
print(tuple(h.shape), tuple(c.shape))
"""


def test_imports_from_anywhere_without_the_workbook(tmp_path):
    """What `pip install` ships: the built package alone, with only torch beside it."""
    lltm()
    env = dict(os.environ, PYTHONPATH=str(build.stage(5).lib_dir))
    result = subprocess.run([sys.executable, "-c", IMPORT_ALONE], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[-2] == "(2, 4) (2, 4)"


def test_module_initialises_uniformly_and_runs():
    check_module_initialises_uniformly_and_runs(lltm().LLTM)


def test_not_a_tensor_raises_type_error():
    x, w, b, h, c = lltm_inputs(2, 3, 4, requires_grad=False)
    with pytest.raises(TypeError, match="`old_h` must be a tensor, got list"):
        lltm().lltm(x, w, b, [[0.0] * 4] * 2, c)


def test_gates_output_takes_no_gradient():
    lltm()
    new_h, new_cell, gates = torch.ops.lltm.forward(*lltm_inputs(2, 3, 4))
    assert new_h.requires_grad and new_cell.requires_grad and not gates.requires_grad


@pytest.mark.parametrize("used", ["new_h", "new_cell"])
def test_gradient_through_one_output_only(used):
    # The other output's gradient reaches the backward as None (set_materialize_grads(False)).
    inputs = lltm_inputs(3, 5, 7, dtype=torch.float64)
    index = ("new_h", "new_cell").index(used)
    grads = torch.autograd.grad(lltm().lltm(*inputs)[index].sum(), inputs)
    ref_inputs = reference.in_float64(*inputs)
    expected = torch.autograd.grad(reference.lltm(*ref_inputs)[index].sum(), ref_inputs)
    for name, g, e in zip(("input", "weights", "bias", "old_h", "old_cell"), grads, expected):
        torch.testing.assert_close(g, e, msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_double_backward_raises_clearly():
    inputs = lltm_inputs(2, 3, 4, dtype=torch.float64)
    new_h, new_cell = lltm().lltm(*inputs)
    grads = torch.autograd.grad(new_h.sum() + new_cell.sum(), inputs, create_graph=True)
    with pytest.raises(RuntimeError, match="lltm: double backward is not supported"):
        torch.autograd.grad(grads[1].sum(), inputs)


def test_backward_op_checks_its_inputs():
    lltm()
    x, w, _, h, c = lltm_inputs(2, 3, 4, requires_grad=False)
    with pytest.raises(ValueError,
                       match=r"lltm_backward: `gates` must have size 12 in dimension 1"):
        torch.ops.lltm.backward(c, c, c, torch.zeros(2, 11), x, h, w)
    with pytest.raises(TypeError, match=r"lltm_backward: `weights` must have dtype Float"):
        torch.ops.lltm.backward(c, c, c, torch.zeros(2, 12), x, h, w.double())


# -- the dispatcher: meta tensors, opcheck, torch.compile ------------------------------------------


def test_meta_inputs_run_the_fake_kernel():
    lltm()
    inputs = lltm_inputs(2, 3, 4, device="meta", requires_grad=False)
    outputs = torch.ops.lltm.forward(*inputs)
    assert [tuple(o.shape) for o in outputs] == [(2, 4), (2, 4), (2, 12)]
    assert all(o.device.type == "meta" and o.dtype == torch.float32 for o in outputs)
    x, w, _, h, c = inputs
    grads = torch.ops.lltm.backward(c, c, c, outputs[2], x, h, w)
    assert [tuple(g.shape) for g in grads] == [(2, 3), (12, 7), (12,), (2, 4), (2, 4)]
    with pytest.raises(ValueError, match=r"`weights` must have size 12 in dimension 0"):
        torch.ops.lltm.forward(x, torch.zeros(15, 7, device="meta"), *inputs[2:])


OPCHECK_SIZES = [(2, 3, 4), (1, 1, 1), (5, 17, 33)]


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("sizes", OPCHECK_SIZES, ids=lambda s: "b{}_f{}_s{}".format(*s))
def test_opcheck_forward(sizes, requires_grad):
    lltm()
    inputs = lltm_inputs(*sizes, dtype=torch.float64, requires_grad=requires_grad)
    torch.library.opcheck(torch.ops.lltm.forward.default, inputs)


def backward_inputs(batch, features, state, requires_grad):
    x, w, b, h, c = lltm_inputs(batch, features, state, dtype=torch.float64, requires_grad=False)
    _, new_cell, gates = torch.ops.lltm.forward(x, w, b, h, c)
    grad_h, grad_cell = torch.randn_like(new_cell), torch.randn_like(new_cell)
    args = (grad_h, grad_cell, new_cell, gates, x, h, w)
    return tuple(t.requires_grad_(requires_grad) for t in args)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("sizes", OPCHECK_SIZES, ids=lambda s: "b{}_f{}_s{}".format(*s))
def test_opcheck_backward(sizes, requires_grad):
    lltm()
    # With inputs that require grad, opcheck's test_aot_dispatch_dynamic differentiates through
    # the backward op, which raises by design (test_double_backward_raises_clearly): the other
    # three checks still run, including that its autograd is registered at the Autograd key.
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    test_utils = utils if requires_grad else (*utils, "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.lltm.backward.default,
                          backward_inputs(*sizes, requires_grad), test_utils=test_utils)


class TwoSteps(torch.nn.Module):
    """A small model around lltm.LLTM: two steps of the cell, then a linear read-out."""

    def __init__(self, cell_type, features=8, state=16):
        super().__init__()
        self.cell = cell_type(features, state)
        self.head = torch.nn.Linear(state, 1)

    def forward(self, x0, x1, h, c):
        h, c = self.cell(x0, (h, c))
        h, c = self.cell(x1, (h, c))
        return self.head(h).sum() + c.mean()


def check_compiled_matches_eager(device, **compile_kwargs):
    torch.manual_seed(0)
    model = TwoSteps(lltm().LLTM).to(device)
    inputs = [torch.randn(4, n, device=device) for n in (8, 8, 16, 16)]
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, **compile_kwargs)
    for _ in range(2 if compile_kwargs.get("mode") == "reduce-overhead" else 1):
        loss_compiled = compiled(*inputs)
        grads_compiled = torch.autograd.grad(loss_compiled, list(model.parameters()))
    loss = model(*inputs)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss_compiled, loss)
    for a, b in zip(grads_compiled, grads):
        torch.testing.assert_close(a, b)


def test_compile_fullgraph_matches_eager():
    check_compiled_matches_eager("cpu")


# -- with a GPU -----------------------------------------------------------------------------------


@requires_cuda
def test_cuda_matches_cpu():
    assert_cuda_matches_cpu(lltm().lltm, lltm().lltm)


@requires_cuda
def test_opcheck_on_cuda():
    lltm()
    torch.library.opcheck(torch.ops.lltm.forward.default,
                          lltm_inputs(3, 5, 1025, device="cuda", dtype=torch.float64))


@requires_cuda
def test_runs_on_the_current_stream_under_graph_capture():
    inputs = lltm_inputs(4, 8, 1025, device="cuda")
    replayed, eager = capture_and_replay(lltm().lltm, inputs)
    for a, b in zip(replayed, eager):
        torch.testing.assert_close(a, b)


@requires_cuda
def test_compile_reduce_overhead_on_cuda():
    """mode="reduce-overhead" replays the compiled graph as a CUDA graph."""
    check_compiled_matches_eager("cuda", mode="reduce-overhead")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_runs_on_the_inputs_device_not_the_current_one():
    assert_runs_on_the_inputs_device(lltm().lltm)
