"""Every op called from many Python threads at once gives bitwise the results of one.

Eight threads each call an op forward and backward 50 times, all started together, on inputs of
their own (each thread a dtype of its own, so four kernel instantiations run side by side) or on
one set of inputs they all share (a model's weights, read by every request); every output and
gradient must be bitwise equal to what a single thread got on the same inputs before. A kernel
with hidden shared state (a static buffer, a cache keyed by the wrong thing, a race in its
intra-op parallel loop) fails here; at::parallel_for's own threads run under each caller too
(the LLTM's case is past its kernels' 8192-element grain).

Every op runs wherever a stage implements it on the CPU (workbook.ops.implementations), at the
size its descriptor names for this (OpSpec.concurrency_case): a new op or stage is tested here
with no edit.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from workbook import ops
from workbook.spec import FLOAT_DTYPES, as_tuple, random_like

THREADS = 8
CALLS = 50


def forward_and_backward(fn, sample, grad_outputs):
    """Outputs and the gradient of every input, detached: one call's results."""
    outputs = as_tuple(sample.call(fn))
    wanted = [t for _, t in sample.differentiable()]
    grads = torch.autograd.grad(outputs, wanted, [g.to(o.dtype) for g, o in
                                                  zip(grad_outputs, outputs)])
    return [o.detach() for o in outputs] + list(grads)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return torch.equal(*as_bytes)


@pytest.mark.parametrize("inputs", ["own", "shared"])
@pytest.mark.parametrize("implementation", ops.implementations(), ids=lambda i: i.key)
def test_threads_get_the_single_thread_results(implementation, inputs):
    spec, fn = implementation.spec, implementation.function()
    case = spec.concurrency_case or spec.demo_case
    samples = [spec.make(case, dtype=FLOAT_DTYPES[k % len(FLOAT_DTYPES)], seed=k)
               for k in range(THREADS)]
    if inputs == "shared":
        samples = [samples[1]] * THREADS  # float32, read by every thread
    grad_outputs = random_like(as_tuple(samples[0].call(fn)))
    expected = [forward_and_backward(fn, s, grad_outputs) for s in samples]
    start = threading.Barrier(THREADS)

    def worker(k):
        start.wait()
        wrong = []
        for call in range(CALLS):
            got = forward_and_backward(fn, samples[k], grad_outputs)
            wrong += [f"thread {k}, call {call}: result {j} differs"
                      for j, (g, e) in enumerate(zip(got, expected[k])) if not bitwise_equal(g, e)]
        return wrong

    with ThreadPoolExecutor(THREADS) as pool:
        found = [line for lines in pool.map(worker, range(THREADS)) for line in lines]
    assert not found, (f"{implementation.key}: {len(found)} results differ from one thread's:\n"
                       + "\n".join(found[:20]))
