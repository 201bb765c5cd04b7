"""The timing harness: medians from torch.utils.benchmark, and the figures that say whether to
believe them.

torch.utils.benchmark warms up, picks a number of runs that fills `min_run_time`, synchronizes
CUDA around each block, and reports the median, which shrugs off the odd slow run.

Threads: `benchmark.Timer` runs its statement with `num_threads` intra-op threads, and its
default is 1. `median_us` and `forward_backward_us` (the notebooks) keep that default; `measure`
and `forward_backward` (make bench) and `interleaved` (make demo) take `num_threads`, and use all
of torch's threads when it is None, so that the time matches the thread count the report prints.

A busy machine fakes numbers. With 2 cores, two spinning OpenMP threads and one other process, a
small op runs 100-200x slower than on a quiet machine, and ratios turn upside down; a median of
one measurement does not show it. So the demo and the benchmark share three guards, here:

  noise      `spread`: IQR / median, of a measurement's blocks (the benchmark) or of interleaved
             rounds (`interleaved`, the demo); a ratio's noise is the larger of its two sides'.
  load       `LoadMonitor`: how much of the cores this process may run on *other* processes used
             while it timed (Linux: /proc/stat less this process's own CPU time); `probe` takes a
             short look before timing, and `choose_threads` leaves the cores others keep busy.
  verdict    `Verdict`: busy when others used BUSY_CORES or more, noisy where a timing's noise
             passed NOISY; either way the timings are said to be unreliable, not results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import statistics
import time
import timeit
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path

import torch
import torch.utils.benchmark as benchmark

# Busy from half a core of other work on the cores we may run on, averaged over the timing. Below
# that the others are a shell, an editor, kernel threads; from there on one of our threads shares
# its core with them about half the time, and every OpenMP parallel region waits for its slowest
# thread. `choose_threads` counts a core as taken from the same half core on.
BUSY_CORES = 0.5
# Noisy past 10% IQR / median: where torch.utils.benchmark's Measurement warns of "system
# fluctuation". A ratio whose sides are both within it can still tell 1x from 1.5x; past it, a
# ratio near 1 can land on either side of 1 from one run to the next.
NOISY = 0.10


@dataclasses.dataclass(frozen=True)
class Timing:
    """One measurement: median and interquartile range of the per-call time, in microseconds."""

    median_us: float
    iqr_us: float
    blocks: int  # how many timed blocks the median is taken over
    calls_per_block: int
    num_threads: int

    @property
    def noise(self) -> float:
        return relative_iqr(self.iqr_us, self.median_us)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def relative_iqr(iqr: float, median: float) -> float:
    """IQR / median: the noise figure of every timing in the workbook (0 for a zero median)."""
    return iqr / median if median > 0 else 0.0


def spread(values: Sequence[float]) -> float:
    """IQR / median of `values` (one value: 0), with the quantiles torch.utils.benchmark takes
    (linear interpolation between the sorted values)."""
    if len(values) < 2:
        return 0.0
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return relative_iqr(q3 - q1, median)


@contextlib.contextmanager
def intra_op_threads(count: int):
    """torch.set_num_threads(count) inside the block, the count before it restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _clock() -> Callable[[], float]:
    """The Timer's clock: CUDA synchronized first where there is a GPU. torch.utils.benchmark's
    own clock asks torch.accelerator, which raises in a process that has named the emulated CUDA
    device without loading it (a test process: workbook.build.emulate), so it is not used."""
    if not torch.cuda.is_available():
        return timeit.default_timer

    def synchronized() -> float:
        torch.cuda.synchronize()
        return timeit.default_timer()

    return synchronized


def _timer(fn: Callable[[], object], threads: int) -> benchmark.Timer:
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads, timer=_clock())


def measure(
    fn: Callable[[], object], *, min_run_time: float = 0.3, num_threads: int | None = None
) -> Timing:
    """Time fn() with torch.utils.benchmark's blocked_autorange; num_threads None: torch's own."""
    threads = torch.get_num_threads() if num_threads is None else num_threads
    m = _timer(fn, threads).blocked_autorange(min_run_time=min_run_time)
    return Timing(m.median * 1e6, m.iqr * 1e6, len(m.times), m.number_per_run, threads)


def median_us(fn: Callable[[], object], *, min_run_time: float = 0.3) -> float:
    """Median wall time of one call of fn(), in microseconds (one intra-op thread, see above)."""
    return measure(fn, min_run_time=min_run_time, num_threads=1).median_us


def autograd_runners(
    fn: Callable[..., Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor] | None = None,
) -> tuple[Callable[[], object], Callable[[], object]]:
    """(forward, backward) calls of fn(*inputs), as the LLTM tutorial times them.

    Forward runs with autograd recording (the inputs require grad, as in training). Backward
    replays one graph, recorded here, with retain_graph=True and `grad_outputs` (ones when None)
    as the incoming gradients: the backward alone, without the forward that built it.
    """
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    grads = (list(grad_outputs) if grad_outputs is not None
             else [torch.ones_like(o) for o in outputs])
    wanted = [t for t in inputs if t.requires_grad]

    def backward():
        torch.autograd.grad(outputs, wanted, grads, retain_graph=True)

    return (lambda: fn(*inputs)), backward


def forward_backward(
    fn: Callable[..., Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    *,
    grad_outputs: Sequence[torch.Tensor] | None = None,
    min_run_time: float = 0.3,
    num_threads: int | None = None,
) -> tuple[Timing, Timing]:
    """(forward, backward) Timings of fn(*inputs), timed one after the other (`autograd_runners`
    says what each phase runs)."""
    forward, backward = autograd_runners(fn, inputs, grad_outputs)
    return tuple(measure(run, min_run_time=min_run_time, num_threads=num_threads)
                 for run in (forward, backward))


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


# ----------------------------------------------------------------------------------------------
# Interleaved rounds: several implementations compared in one stretch of time


@dataclasses.dataclass(frozen=True)
class Repeated:
    """One implementation's rounds: the per-call time of each round's block, in microseconds."""

    rounds_us: tuple[float, ...]
    calls_per_round: int
    num_threads: int

    @property
    def median_us(self) -> float:
        return statistics.median(self.rounds_us)

    @property
    def noise(self) -> float:
        """IQR / median over the rounds: how much this time moved while the others were timed."""
        return spread(self.rounds_us)


def interleaved(runs: Mapping[Hashable, Callable[[], object]], *, rounds: int = 5,
                min_run_time: float = 0.05, num_threads: int | None = None
                ) -> dict[Hashable, Repeated]:
    """Time every run in `rounds` rounds, each round one block of each, the order rotated.

    Timed one after the other, two implementations see two different machines: a compile that
    starts halfway spoils the second alone, and the ratio with it. In rounds, a burst of other
    work spoils one round of everyone, the median over rounds shrugs it off, and the spread over
    rounds (`Repeated.noise`) shows it. The order rotates so that no implementation always runs
    first (after the previous round's last, on caches that one left).

    A block is torch.utils.benchmark's `Timer.timeit(n)` (a short warm-up, then n calls, the
    accelerator synchronized around them), n fixed before the first round so that every round
    times the same work: enough calls to fill `min_run_time`, at least one.
    """
    threads = torch.get_num_threads() if num_threads is None else num_threads
    timers = {key: _timer(fn, threads) for key, fn in runs.items()}
    calls = {key: _calls_to_fill(timer, min_run_time) for key, timer in timers.items()}
    found: dict[Hashable, list[float]] = {key: [] for key in runs}
    order = list(runs)
    for r in range(rounds):
        shift = r % len(order) if order else 0
        for key in order[shift:] + order[:shift]:
            found[key].append(timers[key].timeit(calls[key]).median * 1e6)
    return {key: Repeated(tuple(times), calls[key], threads) for key, times in found.items()}


def _calls_to_fill(timer: benchmark.Timer, seconds: float) -> int:
    """How many calls fill `seconds`, from a warm estimate: the first call (allocations, lazy
    initialisation, cold caches) can be ten times a steady one, and a count taken from it alone
    makes blocks of a few milliseconds, whose medians scatter by tens of percent."""
    first = timer.timeit(1).median
    warm = timer.timeit(max(1, math.ceil(0.2 * seconds / first))).median
    return max(1, math.ceil(seconds / warm))


def ratio(base: Repeated, impl: Repeated) -> tuple[float, float]:
    """(base time / impl time, its noise): above 1 the implementation is faster. The noise is the
    larger of the two sides' (the benchmark's targets take it so): a ratio is no steadier than
    the less steady of the times it divides."""
    return base.median_us / impl.median_us, max(base.noise, impl.noise)


# ----------------------------------------------------------------------------------------------
# Other processes' load on the cores this process may run on


def usable_cpus() -> set[int]:
    """The CPUs this process may run on: its affinity (taskset, a container's cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def _busy_ticks(cpus: set[int]) -> int | None:
    """Clock ticks the CPUs spent busy since boot, everyone's work together, from /proc/stat's
    `cpuN` lines: user nice system idle iowait irq softirq steal (guest time is already in user).
    Busy is all but idle and iowait; steal, a hypervisor running another machine on our core, is
    other work like any. None where there is no /proc/stat (not Linux)."""
    try:
        text = Path("/proc/stat").read_text()
    except OSError:
        return None
    total, seen = 0, False
    for line in text.splitlines():
        name, *fields = line.split()
        if re.fullmatch(r"cpu\d+", name) and int(name[3:]) in cpus:
            values = [int(v) for v in fields[:8]]
            total += sum(values) - values[3] - values[4]
            seen = True
    return total if seen else None


def _own_seconds() -> float:
    """CPU seconds of this process (every thread, user and system) and of the children it has
    waited for (a subprocess.run's): its own work, wherever the scheduler put it."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclasses.dataclass(frozen=True)
class Load:
    """CPU use of the cores this process may run on ("our cores"), averaged over `seconds`, in
    cores: 1.0 is one core kept busy all that time. `busy` is everyone's, `own` this process's;
    None where the system does not say (no /proc/stat)."""

    seconds: float
    cores: int
    busy: float | None = None
    own: float | None = None

    @property
    def others(self) -> float | None:
        """Other processes' use: busy less our own, kept within 0 and the cores (the two are
        counted apart, in ticks of 10 ms, and may disagree by a tick)."""
        if self.busy is None or self.own is None:
            return None
        return min(float(self.cores), max(0.0, self.busy - self.own))

    @property
    def busy_machine(self) -> bool:
        return self.others is not None and self.others >= BUSY_CORES

    def __add__(self, later: Load) -> Load:
        """Two stretches watched apart (the benchmark's configurations) as one: each average
        weighted by its stretch's length."""
        seconds = self.seconds + later.seconds

        def mean(a: float | None, b: float | None) -> float | None:
            if a is None or b is None:
                return None
            return (a * self.seconds + b * later.seconds) / seconds if seconds > 0 else 0.0

        return Load(seconds, max(self.cores, later.cores), mean(self.busy, later.busy),
                    mean(self.own, later.own))

    def describe(self) -> str:
        if self.others is None:
            return "other processes' load is unknown here (no /proc/stat to read)"
        cores = f"{self.cores} core{'s' * (self.cores != 1)}"
        return f"other processes used {self.others:.1f} of our {cores}"

    def as_dict(self) -> dict:
        return dict(dataclasses.asdict(self), others=self.others)

    @classmethod
    def from_dict(cls, d: Mapping) -> Load:
        return cls(d["seconds"], d["cores"], d.get("busy"), d.get("own"))


class LoadMonitor:
    """Watch the cores this process may run on while a block runs:

        with LoadMonitor() as watch:
            ...                                  # the timings
        watch.load.others                        # cores of other work, on average, meanwhile

    `so_far()` reads the load from the start to now without ending the watch (the benchmark
    writes its report after every configuration). Other processes are everything that is not
    this process or a child it has waited for: a compiler, another user's job, a child still
    running (inductor's compile workers, which compete like any other process).
    """

    def __init__(self) -> None:
        self.cpus = usable_cpus()
        self.load: Load | None = None

    def _snapshot(self) -> tuple[float, int | None, float]:
        return time.perf_counter(), _busy_ticks(self.cpus), _own_seconds()

    def __enter__(self) -> LoadMonitor:
        self._start = self._snapshot()
        return self

    def __exit__(self, *exc) -> None:
        self.load = self.so_far()

    def so_far(self) -> Load:
        (t0, busy0, own0), (t1, busy1, own1) = self._start, self._snapshot()
        seconds = t1 - t0
        if busy0 is None or busy1 is None or seconds <= 0:
            return Load(seconds, len(self.cpus))
        tick = os.sysconf("SC_CLK_TCK")
        return Load(seconds, len(self.cpus), (busy1 - busy0) / tick / seconds,
                    (own1 - own0) / seconds)


def probe(seconds: float = 0.3) -> Load:
    """Other processes' load in a short look, this process asleep meanwhile: before timing."""
    with LoadMonitor() as watch:
        time.sleep(seconds)
    return watch.load


def choose_threads(load: Load, most: int | None = None) -> int:
    """Intra-op threads that do not oversubscribe the cores: those this process may run on, less
    those others keep busy (a core counts as taken from BUSY_CORES of it on: 0.4 of a core leaves
    it free, 0.5 takes it), at least 1 and at most `most` (default: every core we may run on)."""
    most = load.cores if most is None else min(most, load.cores)
    if load.others is None:
        return max(1, most)
    taken = math.floor(load.others + 1 - BUSY_CORES)
    return max(1, min(most, load.cores - taken))


# ----------------------------------------------------------------------------------------------
# The verdict: results, or numbers a busy machine made up


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether a set of timings can be read as results.

    Busy: other processes used BUSY_CORES or more of our cores while timing; then every timing is
    unreliable, however steady it looks (a steady competitor makes steadily wrong numbers).
    Noisy: a timing whose noise passed NOISY; that one is unreliable, and so is any ratio it is a
    side of. Reliable: neither. `noisy` keeps the names and noises of the noisy ones only.
    """

    load: Load
    timings: int  # how many timings were judged
    noisy: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def judge(cls, load: Load, noise: Mapping[str, float]) -> Verdict:
        """The verdict on timings named by `noise`'s keys, each with its IQR / median."""
        return cls(load, len(noise), {name: n for name, n in noise.items() if n > NOISY})

    @property
    def busy(self) -> bool:
        return self.load.busy_machine

    @property
    def reliable(self) -> bool:
        return not self.busy and not self.noisy

    def unreliable(self, noise: float) -> bool:
        """Whether a figure with this noise (a timing, a ratio) is unreliable under this verdict."""
        return self.busy or noise > NOISY

    def summary(self) -> str:
        """The verdict in one sentence, what it rests on included."""
        while_timing = f"{self.load.describe()} while timing"
        noisy = (f"{len(self.noisy)} of {self.timings} timings varied more than {NOISY:.0%} "
                 f"(IQR / median): {_some(self.noisy)}")
        if self.busy:
            return (f"the machine is BUSY: {while_timing} (busy from {BUSY_CORES} core); the "
                    f"timings are UNRELIABLE, not results" + (
                        f"; {len(self.noisy)} of {self.timings} also noisier than {NOISY:.0%}"
                        if self.noisy else ""))
        if self.noisy:
            return (f"the timings are NOISY: {noisy}; those are UNRELIABLE, not results "
                    f"({while_timing})")
        steady = f"every timing within {NOISY:.0%} noise (IQR / median)"
        if self.load.others is None:  # the noise alone to go by
            return f"steady: {steady}; {self.load.describe()}"
        return f"quiet: {while_timing}; {steady}"

    def as_dict(self) -> dict:
        return {"reliable": self.reliable, "busy": self.busy, "summary": self.summary(),
                "load": self.load.as_dict(), "timings": self.timings, "noisy": dict(self.noisy),
                "limits": {"busy_cores": BUSY_CORES, "noise": NOISY}}

    @classmethod
    def from_dict(cls, d: Mapping) -> Verdict:
        return cls(Load.from_dict(d["load"]), d["timings"], dict(d["noisy"]))


def _some(noisy: Mapping[str, float], shown: int = 3) -> str:
    worst = sorted(noisy.items(), key=lambda item: -item[1])
    text = ", ".join(f"{name} {n:.0%}" for name, n in worst[:shown])
    return text + (f" and {len(worst) - shown} more" if len(worst) > shown else "")


# ----------------------------------------------------------------------------------------------
# The machine, in the reports' words


def describe_machine(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    threads = torch.get_num_threads()
    return f"CPU, {threads} thread{'s' * (threads != 1)}, torch {torch.__version__}"


def machine_slug(device: str) -> str:
    """A short file-name-safe name for result files: `cpu-2threads`, `nvidia-h200`."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(device)
        return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cuda"
    return f"cpu-{torch.get_num_threads()}threads"
