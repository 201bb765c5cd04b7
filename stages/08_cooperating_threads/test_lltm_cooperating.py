"""Stage 08: the LLTM with CUDA kernels whose threads cooperate (csrc/lltm_cooperating.cuh).

The op is stage 05's in everything but its CUDA matrix products and bias gradient, so these
tests are about those kernels: the float64 reference in every dtype, at sizes whose tiles do not
fill (M, N and K not multiples of 16) and whose columns take several turns of the row loop;
gradcheck; strided and transposed inputs, which the tiled kernel reads through their strides;
the bias gradient against the CPU's in float64; a backward that gives the same bits on every run,
in every order the threads run in. Without a GPU they run on the emulated CUDA device, which
also fails any launch whose barriers or shuffles some threads never reach (synccheck); `make
racecheck 8` runs them under ThreadSanitizer, which reports a missing barrier as a race. What is
stage 05's (the CPU kernels, the fake kernels, torch.compile, the checks) is tested there.
"""

import pytest
import torch

from workbook import ops, testing
from workbook.build import builder, stages, toolkit
from workbook.build.loader import import_stage
from workbook.ops import lltm as lltm_op
from workbook.spec import Case

SPEC = ops.get("lltm")
STAGE = stages.here(__file__)
CUDA = [testing.CUDA]

# M = batch, N = 3 state, K = state + features: tiles that fill in no dimension, several tiles of
# K, and batches past 256 rows (the column sums' row loop takes several turns).
TILE_CASES = (
    Case("b17_f3_s6", {"batch": 17, "features": 3, "state": 6}),
    Case("b33_f20_s15", {"batch": 33, "features": 20, "state": 15}, full_gradcheck=False),
    Case("b300_f7_s5", {"batch": 300, "features": 7, "state": 5}, full_gradcheck=False),
    Case("b1000_f2_s70", {"batch": 1000, "features": 2, "state": 70}, full_gradcheck=False),
)
# The launch edges: empty tensors (no launch, or K = 0: a product of zeros), state 1, and batches
# past 65535 blocks of rows for stage 05's pointwise kernels, whose launches this stage keeps.
EDGE_CASES = tuple(c for c in lltm_op.CUDA_EDGE_CASES if c.sizes["batch"] * c.sizes["state"]
                   <= 2_000_000)
# The op's cases without the states wider than one block (1025, 1500): those are the concern of
# stage 05's pointwise kernels, and run in its tests (and stages 04's and 10's); the tiled
# product takes any width the same way, in tiles of 16 (TILE_CASES: partial tiles, several of K).
CASES = tuple(c for c in lltm_op.CUDA_CASES if c["state"] <= 1024)


def package():
    return import_stage(STAGE)


def lltm(*args, **kwargs):
    return package().lltm(*args, **kwargs)


def op(name: str):
    package()
    return getattr(getattr(torch.ops, STAGE.package), name)


@pytest.mark.parametrize("p", testing.params(SPEC, CUDA, cases=CASES))
def test_against_reference(p):
    testing.assert_against_reference(lltm, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("p", testing.params(SPEC, CUDA, cases=TILE_CASES, batch0=False))
def test_tiles_that_do_not_fill(p):
    testing.assert_against_reference(lltm, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("p", testing.params(SPEC, CUDA, [torch.float64], cases=TILE_CASES[:2],
                                             batch0=False))
def test_gradcheck(p):
    testing.assert_gradcheck(lltm, SPEC, p.sample(SPEC), fast_mode=not p.case.full_gradcheck)


@pytest.mark.parametrize("p", testing.params(SPEC, CUDA, cases=EDGE_CASES, batch0=False))
def test_edge_cases(p):
    testing.assert_against_reference(lltm, SPEC, p.sample(SPEC))


@pytest.mark.parametrize("layout", ["strided", "permuted", "expanded"])
def test_layouts(layout):
    testing.assert_layout(lltm, SPEC, SPEC.make(SPEC.case("b5_f17_s33"), device=testing.CUDA),
                          layout)


@testing.requires_cuda
def test_bias_gradient_sums_every_row():
    """d_bias is the column sums of d_gates: on the device as on the CPU, in float64, for a batch
    that takes every turn of the row loop (1000 rows: 3 turns and a part of 256 threads)."""
    forward, backward = op("lltm_forward"), op("lltm_backward")
    grads = []
    for device in ("cpu", testing.CUDA):
        torch.manual_seed(0)
        x, w, b, h, c = lltm_op.inputs(1000, 3, 40, dtype=torch.float64, requires_grad=False)
        x, w, b, h, c = (t.to(device) for t in (x, w, b, h, c))
        new_h, new_cell, gates = forward(x, w, b, h, c)
        grad_h = torch.linspace(-1, 1, new_h.numel(), dtype=torch.float64).view_as(new_h)
        grads.append(backward(grad_h.to(device), torch.ones_like(new_cell), new_cell, gates, x,
                              h, w))
    cpu_bias, device_bias = grads[0][2], grads[1][2].cpu()
    torch.testing.assert_close(device_bias, cpu_bias, rtol=1e-12, atol=1e-12)


@testing.requires_cuda
def test_backward_is_bitwise_reproducible(monkeypatch):
    """No atomics: each element of every gradient is one thread's sum in a fixed order, so the
    backward gives the same bits on every run, and on the emulated device in every order its
    blocks and threads are run in (shuffled from three seeds)."""
    torch.manual_seed(0)
    x, w, b, h, c = (t.detach().to(testing.CUDA) for t in lltm_op.inputs(300, 7, 20))
    runs = []
    for seed in ("0", "1", "2"):
        if testing.EMULATED:
            monkeypatch.setenv("WORKBOOK_EMULATE_ORDER", "shuffle")
            monkeypatch.setenv("WORKBOOK_EMULATE_SEED", seed)
        inputs = [t.clone().requires_grad_() for t in (x, w, b, h, c)]
        new_h, new_cell = lltm(*inputs)
        (new_h.sum() + (new_cell * new_cell).sum()).backward()
        runs.append([t.grad.cpu() for t in inputs])
    for run in runs[1:]:
        for first, again in zip(runs[0], run):
            assert torch.equal(first, again)


@testing.requires_cuda
def test_cuda_matches_cpu():
    testing.assert_cuda_matches_cpu(lltm, SPEC, SPEC.case("b5_f17_s33").with_sizes(state=100))


@pytest.mark.parametrize(("device", "bad"), testing.bad_input_params(SPEC, CUDA))
def test_bad_input(device, bad):
    testing.assert_bad_input(lltm, bad, device)


# -- the package ----------------------------------------------------------------------------------


def test_cuda_kernels_are_compiled_in_when_nvcc_is_found():
    forward = op("lltm_forward").default.name()  # "lltm_coop::lltm_forward"
    assert forward == f"{STAGE.package}::lltm_forward"
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
