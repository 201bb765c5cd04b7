"""The timing harness: medians from torch.utils.benchmark, forward and backward timed apart.

torch.utils.benchmark warms up, picks a number of runs that fills `min_run_time`, synchronizes
CUDA around each block, and reports the median, which shrugs off the odd slow run.

Threads: `benchmark.Timer` runs its statement with `num_threads` intra-op threads, and its
default is 1. `median_us` and `forward_backward_us` (the notebooks) keep that default; `measure`
and `forward_backward` (make demo, make bench) take `num_threads`, and use all of torch's threads
when it is None, so that the time matches the thread count the report prints.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import torch
import torch.utils.benchmark as benchmark


@dataclasses.dataclass(frozen=True)
class Timing:
    """One measurement: median and interquartile range of the per-call time, in microseconds."""

    median_us: float
    iqr_us: float
    blocks: int  # how many timed blocks the median is taken over
    calls_per_block: int
    num_threads: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def measure(
    fn: Callable[[], object], *, min_run_time: float = 0.3, num_threads: int | None = None
) -> Timing:
    """Time fn() with torch.utils.benchmark's blocked_autorange; num_threads None: torch's own."""
    threads = torch.get_num_threads() if num_threads is None else num_threads
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
    m = timer.blocked_autorange(min_run_time=min_run_time)
    return Timing(m.median * 1e6, m.iqr * 1e6, len(m.times), m.number_per_run, threads)


def median_us(fn: Callable[[], object], *, min_run_time: float = 0.3) -> float:
    """Median wall time of one call of fn(), in microseconds (one intra-op thread, see above)."""
    return measure(fn, min_run_time=min_run_time, num_threads=1).median_us


def forward_backward(
    fn: Callable[..., Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    *,
    grad_outputs: Sequence[torch.Tensor] | None = None,
    min_run_time: float = 0.3,
    num_threads: int | None = None,
) -> tuple[Timing, Timing]:
    """(forward, backward) Timings of fn(*inputs), as the LLTM tutorial reports them.

    Forward is timed with autograd recording (the inputs require grad, as in training).
    Backward is timed alone: the graph is built once and replayed with retain_graph=True, with
    `grad_outputs` (ones when None) as the incoming gradients.
    """
    forward = measure(lambda: fn(*inputs), min_run_time=min_run_time, num_threads=num_threads)
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    grads = (list(grad_outputs) if grad_outputs is not None
             else [torch.ones_like(o) for o in outputs])
    wanted = [t for t in inputs if t.requires_grad]

    def backward():
        torch.autograd.grad(outputs, wanted, grads, retain_graph=True)

    return forward, measure(backward, min_run_time=min_run_time, num_threads=num_threads)


def forward_backward_us(
    fn: Callable[..., Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    *,
    min_run_time: float = 0.3,
) -> tuple[float, float]:
    """(forward, backward) median microseconds of fn(*inputs), one intra-op thread (see above).

    Forward is timed under no_grad-free conditions (autograd records the graph, as in training).
    Backward is timed alone: the graph is built once and replayed with retain_graph=True.
    """
    forward, backward = forward_backward(fn, inputs, min_run_time=min_run_time, num_threads=1)
    return forward.median_us, backward.median_us


def describe_machine(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"


def machine_slug(device: str) -> str:
    """A short file-name-safe name for result files: `cpu-2threads`, `nvidia-h200`."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(device)
        return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cuda"
    return f"cpu-{torch.get_num_threads()}threads"
