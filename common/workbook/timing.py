"""The timing harness: medians from torch.utils.benchmark, forward and backward timed apart.

torch.utils.benchmark warms up, picks a number of runs that fills `min_run_time`, synchronizes
CUDA around each block, and reports the median, which shrugs off the odd slow run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.utils.benchmark as benchmark


def median_us(fn: Callable[[], object], *, min_run_time: float = 0.3) -> float:
    """Median wall time of one call of fn(), in microseconds."""
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn})
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e6


def forward_backward_us(
    fn: Callable[..., Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    *,
    min_run_time: float = 0.3,
) -> tuple[float, float]:
    """(forward, backward) median microseconds of fn(*inputs), as the LLTM tutorial reports them.

    Forward is timed under no_grad-free conditions (autograd records the graph, as in training).
    Backward is timed alone: the graph is built once and replayed with retain_graph=True.
    """
    forward = median_us(lambda: fn(*inputs), min_run_time=min_run_time)
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    grads = [torch.ones_like(o) for o in outputs]
    wanted = [t for t in inputs if t.requires_grad]

    def backward():
        torch.autograd.grad(outputs, wanted, grads, retain_graph=True)

    return forward, median_us(backward, min_run_time=min_run_time)


def describe_machine(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"
