"""What the CUDA LLTM stages (04, 05) are tested with on top of lltm_base: larger state sizes,
half-precision tolerances, and a CUDA graph capture that proves the kernels use the current stream.
Everything that needs a GPU is skipped, with the reason, where none is visible."""

import pytest
import torch
from lltm_base import LLTMOpTest, lltm_inputs

from workbook.testing import BadInput, Case

NO_CUDA = "no CUDA device visible (torch.cuda.is_available() is False)"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)

# Beyond the shared cases: a state wider than one block, with a partial last block.
CUDA_CASES = [
    *LLTMOpTest.cases,
    Case("b1_f8_s1025", {"batch": 1, "features": 8, "state": 1025}, full_gradcheck=False),
    Case("b3_f5_s1500", {"batch": 3, "features": 5, "state": 1500}, full_gradcheck=False),
]
CUDA_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# Half and bfloat16 round every GEMM output and every stored gate: looser than the base's bounds.
REDUCED_PRECISION_TOLERANCES = {torch.float16: (2e-2, 2e-2), torch.bfloat16: (8e-2, 8e-2)}


def bad_inputs_without_cuda():
    """Stands in for bad inputs built on a CUDA device: one test, skipped with the reason."""
    return [BadInput("on_cuda", lambda: pytest.skip(NO_CUDA), Exception, "")]


def capture_and_replay(fn, inputs):
    """Capture forward + backward of fn in a CUDA graph, replay it on new input values, and return
    (replayed, eager): outputs then gradients of each. A kernel launched on any stream but the
    current one (the capture stream) makes the capture fail."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the graph, as capture requires
        for _ in range(2):
            torch.autograd.grad(sum(o.sum() for o in fn(*inputs)), inputs)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn(*inputs)
        grads = torch.autograd.grad(sum(o.sum() for o in outputs), inputs)

    batch, features = inputs[0].shape
    fresh = lltm_inputs(batch, features, inputs[3].shape[1], device="cuda", seed=7)
    with torch.no_grad():
        for static, new in zip(inputs, fresh):
            static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    eager_outputs = fn(*fresh)
    eager_grads = torch.autograd.grad(sum(o.sum() for o in eager_outputs), fresh)
    return (*outputs, *grads), (*eager_outputs, *eager_grads)


def assert_cuda_matches_cpu(cpu_fn, cuda_fn, batch=7, features=13, state=1029):
    """The CUDA implementation against a CPU one, outputs and every input gradient (float32)."""
    inputs = lltm_inputs(batch, features, state, dtype=torch.float32)
    cuda_inputs = [t.detach().cuda().requires_grad_() for t in inputs]
    out_cpu, out_cuda = cpu_fn(*inputs), cuda_fn(*cuda_inputs)
    for a, b in zip(out_cpu, out_cuda):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-5)
    grads_cpu = torch.autograd.grad(sum(o.sum() for o in out_cpu), inputs)
    grads_cuda = torch.autograd.grad(sum(o.sum() for o in out_cuda), cuda_inputs)
    for a, b in zip(grads_cpu, grads_cuda):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-4)


def assert_runs_on_the_inputs_device(fn):
    """With cuda:0 current and the inputs on cuda:1, the kernels run (and write) on cuda:1."""
    inputs = lltm_inputs(3, 5, 33, device="cuda:1", requires_grad=False)
    with torch.cuda.device(0):
        out = fn(*inputs)
    expected = fn(*(t.to("cuda:0") for t in inputs))
    for a, b in zip(out, expected):
        assert a.device == torch.device("cuda:1")
        torch.testing.assert_close(a.to("cuda:0"), b)
