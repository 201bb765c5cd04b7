"""The benchmark harness: what every op's benchmark shares, written once.

Run card
  make bench [OP=name]     or   python bench/run.py [--op NAME|all] [--smoke] [--threads N]
                                       [--device cpu|cuda|all] [--out DIR] [--min-run-time S]
  python bench/run.py --render bench/results/lltm/cpu-2threads.json      rebuild its .md and .png

An op module (common/workbook/ops/<op>/bench.py) names its configurations, its baselines and
reference lines, and its targets, in an `OpBench`; this file does the rest, the same way for every
op and device:

  1. discover: every stage whose stage.toml lists the op and that runs on the device;
  2. validate: each implementation against the float64 reference with workbook.spec.compare,
     the comparison the stage tests assert; one that is off, gives NaN or raises is refused,
     reported and never timed;
  3. time: torch.utils.benchmark medians per phase, in rounds interleaved over the implementations
     and thread counts, each keeping its lowest round's median, with IQR / median as the noise;
     other processes' CPU use is watched meanwhile (workbook.measure.timing.LoadMonitor), and the
     verdict (busy, noisy, or quiet: timing.Verdict) heads the report;
  4. compare: ratios against the baselines; reference lines (the GEMMs alone, a dense convolution
     of the same shape) are timed in the same rounds, never validated;
  5. memory: peak memory growth of one forward + backward, each in a fresh process (where asked);
  6. targets: met / missed / not evaluated, with the noise; a missed speed target is profiled;
  7. report: <out>/<slug>.json and .md rewritten after every configuration, so a run cut short
     still leaves what it measured; the .png when the run ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import gc
import importlib
import importlib.util
import itertools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from workbook.build import stages  # imports no torch

REPO = stages.REPO
# The dtypes a run can take its inputs in (bench/run.py --dtype); the reference stays float64.
DTYPES = ("float32", "bfloat16", "float16", "float64")

# Inductor's generated code and its caches go under build/, like every other build output; set
# before torch is imported, which reads it.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(stages.build_root() / "inductor"))

import torch  # noqa: E402

from workbook.build import builder, compiler  # noqa: E402
from workbook.build.loader import StageConflict, import_stage  # noqa: E402
from workbook.measure import timing  # noqa: E402
from workbook.spec import OpSpec, Sample, as_tuple, compare, random_like  # noqa: E402

compiler.prepare()  # ninja on PATH and CUDA_HOME set before a stage builds (see workbook.build)

Runners = dict[str, Callable[[], object]]

# How each phase is timed, in the report's words.
PHASE_METHOD = {
    "forward": "forward timed with autograd recording",
    "backward": "backward alone (graph replayed with retain_graph=True)",
    "forward_backward": "forward + backward timed together (one forward, then the gradients of "
                        "every input that requires grad)",
}
PHASE_TITLE = {"forward": "Forward", "backward": "Backward",
               "forward_backward": "Forward + backward"}
PHASE_SHORT = {"forward": "fwd", "backward": "bwd", "forward_backward": "fwd+bwd"}

# ----------------------------------------------------------------------------------------------
# What an op module declares


@dataclasses.dataclass(frozen=True)
class Config:
    """One input configuration: a name for the report and the sizes the op's sample maker reads."""

    name: str
    sizes: Mapping[str, int]
    description: str = ""  # the report's heading; by default "batch 16, features 32, state 128"
    sweep: str | None = None  # in a sweep: the size that varies (the plot's x axis)

    def describe(self) -> str:
        return self.description or describe_sizes(self.sizes)

    @property
    def shape_key(self) -> tuple:
        """Equal sizes are measured once (a sweep point may be the tutorial's configuration)."""
        return tuple(sorted(self.sizes.items()))


def describe_sizes(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sizes.items())


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one op runs on one device."""

    configs: tuple[Config, ...]
    min_run_time: float  # seconds per torch.utils.benchmark measurement, at least
    profile_iters: int  # calls per torch.profiler window, for missed targets
    # Rounds, interleaved over the implementations and thread counts; each keeps its lowest
    # round's median. On a shared machine a burst of other work then spoils one round of
    # everyone instead of every round of one implementation.
    rounds: int = 1
    threads: tuple[int, ...] = ()  # intra-op thread counts timed; () means torch's current count
    # A call slower than min_run_time / min_blocks is timed over at least min_blocks calls, so
    # that a one-second call still has a median of several and an IQR.
    min_blocks: int = 1
    memory: tuple[str, ...] = ()  # configurations whose peak memory of forward + backward is taken
    memory_repeats: int = 1
    dtype: str = "float32"  # one of DTYPES

    def thread_counts(self) -> tuple[int, ...]:
        return self.threads or (torch.get_num_threads(),)

    def config(self, name: str) -> Config:
        return next(c for c in self.configs if c.name == name)


@dataclasses.dataclass
class Impl:
    """An implementation of the op, or a reference line.

    An implementation is called like the op, `fn(*sample.args, **sample.kwargs)`, validated, then
    timed. A reference line (`runners` set) is what the implementations are read against, not an
    implementation: the GEMMs alone, a dense convolution of the same shape. It makes its own inputs
    and calls per phase, is timed in the same rounds, and is never validated.
    """

    key: str  # "eager", "compile", "stage06", "gemm_floor"
    label: str
    fn: Callable | None = None
    prepare: Callable[[Config], None] = lambda config: None  # before each configuration
    note: str = ""  # how it is set up, for the report (torch.compile's options)
    runners: Callable[[Config, str, Sequence[str]], Runners] | None = None

    @property
    def reference_line(self) -> bool:
        return self.runners is not None


@dataclasses.dataclass(frozen=True)
class Target:
    """A goal, reported and never asserted. Kinds, at the configuration's most threads unless
    `threads` names the thread count a speedup or within target is read at:

    speedup  base time / impl time >= threshold       (phase "step": the phases summed)
    within   impl time / base time <= threshold       (no more than threshold times slower)
    threads  impl time at the fewest threads / at the most threads >= threshold
    memory   impl peak memory / base peak memory <= threshold
    custom   computed by the op module (OpBench.evaluate_custom): LLTM's bandwidth fraction
    """

    name: str
    config: str
    impl: str
    base: str
    phase: str
    threshold: float
    kind: str = "speedup"
    threads: int | None = None  # speedup, within: read at this thread count (None: the most)

    @property
    def at_most(self) -> bool:
        return self.kind in ("within", "memory")


@dataclasses.dataclass
class OpBench:
    """An op's benchmark: everything the harness needs to know about it
    (common/workbook/ops/<op>/bench.py's BENCH)."""

    op: str  # the op's name: its descriptor, stage.toml's `ops`, the stages' function name
    title: str  # "LLTM benchmark"
    spec: OpSpec  # the descriptor: float64 reference, output names, tolerances
    phases: tuple[str, ...]  # of "forward", "backward", "forward_backward"
    baselines: tuple[str, ...]  # implementation keys every ratio is taken against
    plan: Callable[[str, bool], Plan]  # (device, smoke) -> the plan
    sample: Callable[[Config, str, torch.dtype], Sample]  # a configuration's inputs
    implementations: Callable[[str], list[Impl]]  # baselines and reference lines on a device
    targets: Callable[[str], list[Target]]
    floor: str | None = None  # the reference line a missed target's Amdahl argument uses
    floor_phrase: str = ""  # how the report names the floor: "the GEMMs"
    step: bool = False  # also a "step" ratio, the phases summed (LLTM: forward + backward)
    # Optional hooks, each given the running DeviceRun or the report:
    summary_line: Callable[[dict], str] | None = None  # one result row as a line of text
    measure_extra: Callable[[DeviceRun], None] | None = None  # after the configurations
    markdown_extra: Callable[[dict], list[str]] | None = None  # sections of its own
    evaluate_custom: Callable[[Target, dict], tuple[float | None, float | None, str]] | None = None
    upgrade: Callable[[dict], dict] | None = None  # an older report's layout into today's


def load_op(name: str) -> OpBench:
    """The benchmark of op `name`: the BENCH of its folder's bench.py (workbook.ops.having
    ("bench") lists the ops that have one)."""
    module = f"workbook.ops.{name}.bench"
    if importlib.util.find_spec(f"workbook.ops.{name}") is None or \
            importlib.util.find_spec(module) is None:
        raise LookupError(f"no benchmark for op {name!r}: expected "
                          f"common/workbook/ops/{name}/bench.py defining BENCH")
    return importlib.import_module(module).BENCH


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


# ----------------------------------------------------------------------------------------------
# Implementations from the stages


def stage_key(s: stages.Stage) -> str:
    return f"stage{s.number:02d}"


def _not_on(s: stages.Stage, devices: Sequence[str]) -> str:
    why = ("no GPU visible here" if "cuda" in s.devices and not torch.cuda.is_available()
           else f"this run benchmarks {'/'.join(devices) or 'no device'}")
    return f"{s.folder}: runs on {'/'.join(s.devices)} only; {why}"


def load_stages(ops: Sequence[str], devices: Sequence[str]) -> dict[int, Any]:
    """Build and import every stage that implements one of `ops` and runs on one of `devices`:
    {number: its package, or the reason (a str) it does not run}.

    Two stages that build one package (06, 07, 09 and 10 build `extops`) cannot both be imported in
    one process: the one with the most ops, the newest of those (stages.fullest), is imported
    first and measured, and the others are reported as not run, with the reason. Then the rest,
    highest number first.
    """
    wanted = {s.number: s for op in ops for s in stages.providing(op)}
    first = {s.number for s in stages.fullest(list(wanted.values())).values()}
    found: dict[int, Any] = {}
    for number in sorted(wanted, key=lambda n: (n not in first, -n)):
        s = wanted[number]
        if not any(d in devices for d in s.devices):
            found[number] = _not_on(s, devices)
            continue
        try:
            found[number] = import_stage(s)
        except builder.StageSkipped as reason:
            found[number] = str(reason)
        except StageConflict:
            measured = [f"{wanted[n].number:02d}" for n, m in found.items()
                        if not isinstance(m, str) and wanted[n].package == s.package]
            found[number] = (f"{s.folder}: builds the package `{s.package}`, as stage "
                             f"{', '.join(measured)} does, which this run measures instead (a "
                             f"package loads once per process)")
        except Exception as error:  # a stage that does not build is reported, not fatal
            found[number] = (f"{s.folder}: failed to build or import: {type(error).__name__}: "
                             f"{first_line(error)}")
    return found


def stage_implementation(op: str, s: stages.Stage, package) -> Impl:
    return Impl(stage_key(s), f"stage {s.folder}", getattr(package, op))


def stage_implementations(op: str, device: str, loaded: Mapping[int, Any]
                          ) -> tuple[list[Impl], dict[str, str]]:
    """(the stages' implementations of `op` on `device`, {stage key: why not run})."""
    impls, skipped = [], {}
    for s in stages.providing(op):
        package = loaded.get(s.number, f"{s.folder}: not loaded in this run")
        if device not in s.devices:
            skipped[stage_key(s)] = _not_on(s, [device])
        elif isinstance(package, str):
            skipped[stage_key(s)] = package
        elif not hasattr(package, op):
            skipped[stage_key(s)] = f"{s.folder}: its package `{s.package}` has no `{op}`"
        else:
            impls.append(stage_implementation(op, s, package))
    return impls, skipped


def find_implementation(bench: OpBench, device: str, key: str) -> Impl:
    """One implementation by key, loading only the stage it needs (for a fresh process)."""
    if re.fullmatch(r"stage\d+", key):
        s = stages.get(int(key.removeprefix("stage")))
        return stage_implementation(bench.op, s, import_stage(s))
    return next(i for i in bench.implementations(device) if i.key == key)


# ----------------------------------------------------------------------------------------------
# Validation: workbook.spec.compare, the one comparison


@dataclasses.dataclass
class Validation:
    ok: bool
    errors: dict[str, float]  # max |error| / max |reference|, per output and gradient
    worst: float
    reason: str = ""
    no_kernel: bool = False  # the implementation has no kernel for this device: not run, not wrong


def incoming_gradients(spec: OpSpec, sample: Sample) -> tuple[torch.Tensor, ...]:
    """Seeded random incoming gradients shaped like the outputs (ones would let a swapped or
    transposed gradient pass), float64; validation and timing use the same ones."""
    with torch.no_grad():
        outputs = as_tuple(sample.call(spec.reference))
    return random_like(outputs)


def _no_kernel(error: BaseException) -> bool:
    """The dispatcher's 'Could not run ... with arguments from the CUDA backend': a stage without a
    kernel for this device (an op with CPU kernels only, say)."""
    return isinstance(error, NotImplementedError) and "backend" in str(error)


def validate(fn: Callable, spec: OpSpec, sample: Sample,
             grad_outputs: Sequence[torch.Tensor]) -> Validation:
    """fn against the float64 reference (outputs and every input gradient), at the descriptor's
    tolerance for the sample's dtype; anything it raises is a refusal with the reason."""
    try:
        comparison = compare(fn, spec, sample, grad_outputs=grad_outputs)
    except Exception as error:
        return Validation(False, {}, math.nan, f"raised {type(error).__name__}: "
                          f"{first_line(error)}", no_kernel=_no_kernel(error))
    errors = {d.what: d.max_rel for d in comparison.differences}
    return Validation(comparison.ok, errors, comparison.worst(), "; ".join(comparison.failures()))


# ----------------------------------------------------------------------------------------------
# Timing


def phase_runners(fn: Callable, sample: Sample, grad_outputs: Sequence[torch.Tensor],
                  phases: Sequence[str]) -> Runners:
    """One call per phase, as the report times it (see PHASE_METHOD). The backward phase records
    its graph once, here, and replays it."""
    wanted = [t for _, t in sample.differentiable()]
    grads = [g.to(sample.dtype) for g in grad_outputs]
    runners: Runners = {}
    if "forward" in phases:
        runners["forward"] = lambda: sample.call(fn)
    if "backward" in phases:
        outputs = as_tuple(sample.call(fn))
        runners["backward"] = lambda: torch.autograd.grad(outputs, wanted, grads,
                                                          retain_graph=True)
    if "forward_backward" in phases:
        runners["forward_backward"] = lambda: torch.autograd.grad(
            as_tuple(sample.call(fn)), wanted, grads)
    return runners


def copy_bandwidth(run: DeviceRun, values: int) -> dict:
    """A device-to-device copy of `values` elements (read once, written once), timed from
    torch.profiler's kernel records like the kernels it is compared with: the ceiling a
    memory-bound kernel is read against."""
    src = torch.rand(values, device=run.device, dtype=run.dtype)
    dst = torch.empty_like(src)
    rows = profile_rows(lambda: dst.copy_(src), run.device, run.plan.profile_iters)
    kernel_us = sum(r["us_per_call"] for r in rows if r["kind"] == "kernel")
    moved = 2 * values * src.element_size()
    return {"bytes": moved, "kernel_us": kernel_us,
            "GBps": moved / kernel_us / 1e3 if kernel_us else None,
            "kernels": [r["name"] for r in rows if r["kind"] == "kernel"]}


def sample_runners(fn: Callable, make_sample: Callable[[Config, str], Sample]):
    """A reference line's `runners` for a plain function on inputs of its own (F.conv2d at the
    op's shape): timed like an implementation, never compared with the op's reference."""
    def runners(config: Config, device: str, phases: Sequence[str]) -> Runners:
        sample = make_sample(config, device)
        with torch.no_grad():
            outputs = as_tuple(sample.call(fn))
        return phase_runners(fn, sample, random_like(outputs), phases)
    return runners


def time_call(run: Callable[[], object], *, min_run_time: float, threads: int,
              min_blocks: int) -> timing.Timing:
    """timing.measure with `threads` intra-op threads, over at least `min_blocks` calls."""
    if min_blocks > 1:
        with timing.intra_op_threads(threads):
            start = time.perf_counter()
            run()  # also the warm-up
            one_call = time.perf_counter() - start
        min_run_time = max(min_run_time, min_blocks * one_call)
    return timing.measure(run, min_run_time=min_run_time, num_threads=threads)


def runners_for(impl: Impl, config: Config, device: str, sample: Sample,
                grad_outputs: Sequence[torch.Tensor], phases: Sequence[str]) -> Runners:
    if impl.reference_line:
        return impl.runners(config, device, phases)
    return phase_runners(impl.fn, sample, grad_outputs, phases)


def add_ratios(rows: Mapping[tuple[str, int], dict], baselines: Sequence[str],
               phases: Sequence[str], step: bool) -> None:
    """vs_<base>: baseline time / implementation time per phase, at the same thread count (above
    1: the implementation is faster); with `step`, also of the phases summed."""
    for (_, threads), row in rows.items():
        if row["reference_line"]:
            continue
        for base in baselines:
            b = rows.get((base, threads))
            if b is None:
                continue
            ratio = {p: b[p]["median_us"] / row[p]["median_us"] for p in phases}
            if step:
                ratio["step"] = (sum(b[p]["median_us"] for p in phases)
                                 / sum(row[p]["median_us"] for p in phases))
            row[f"vs_{base}"] = ratio


# ----------------------------------------------------------------------------------------------
# Peak memory of one forward + backward, each measurement in a fresh process

MEMORY_METHOD = {
    "cpu": "growth of the peak resident set size (VmHWM) over the resident size just before one "
           "forward + backward, after a warm-up call, in a process started for the configuration; "
           "before each measurement freed memory is returned to the system (malloc_trim) and the "
           "peak reset (/proc/self/clear_refs), and glibc maps every allocation of 64 KiB or more "
           "on its own (MALLOC_MMAP_THRESHOLD_), so what one implementation freed is not reused "
           "unseen by the next: the peak follows the live tensors",
    "cuda": "torch.cuda.max_memory_allocated() over memory_allocated() just before one forward + "
            "backward, after a warm-up call, in a process started for the configuration",
}


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(),
                         re.MULTILINE).group(1))


def peak_growth_bytes(run: Callable[[], object], device: str) -> int:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    run()
    return (_status_kib("VmHWM") - before) * 1024


def _probe_one(bench: OpBench, device: str, key: str, config: Config, dtype: torch.dtype,
               repeats: int) -> dict:
    impl = find_implementation(bench, device, key)
    impl.prepare(config)
    sample = None if impl.reference_line else bench.sample(config, device, dtype)
    grads = () if impl.reference_line else incoming_gradients(bench.spec, sample)
    run = runners_for(impl, config, device, sample, grads, ("forward_backward",))
    run["forward_backward"]()  # warm-up: lazy initialisation, thread pools, kernel caches
    return {"samples_MB": [peak_growth_bytes(run["forward_backward"], device) / 2**20
                           for _ in range(repeats)]}


def probe_memory(request: dict) -> dict:
    """In the process `measure_memory` starts (`run.py --probe-memory`): {impl key: {"samples_MB":
    [...]} or {"error": why}} at one configuration."""
    bench, device = load_op(request["op"]), request["device"]
    torch.set_num_threads(request["threads"])
    config, dtype = Config(**request["config"]), getattr(torch, request["dtype"])
    found = {}
    for key in request["impls"]:
        try:
            found[key] = _probe_one(bench, device, key, config, dtype, request["repeats"])
        except Exception as error:
            found[key] = {"error": f"{type(error).__name__}: {first_line(error)}"}
    return found


def measure_memory(op: str, device: str, impls: Sequence[Impl], config: Config, plan: Plan,
                   threads: int) -> dict[str, dict]:
    """Peak memory growth of one forward + backward per implementation (MEMORY_METHOD):
    {key: {"peak_MB", "samples_MB", "noise"} or {"error"}}."""
    request = {"op": op, "device": device, "impls": [i.key for i in impls], "threads": threads,
               "config": dataclasses.asdict(config), "repeats": plan.memory_repeats,
               "dtype": plan.dtype}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=os.pathsep.join(
        [str(REPO / "common"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(REPO / "bench" / "run.py"), "--probe-memory", json.dumps(request)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800,
                          check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {i.key: {"error": f"the measuring process failed (exit {proc.returncode}): {why}"}
                for i in impls}
    return {key: _summary(found) for key, found in json.loads(lines[-1]).items()}


def _summary(found: dict) -> dict:
    if "error" in found:
        return found
    samples = found["samples_MB"]
    peak = statistics.median(samples)
    return {"peak_MB": peak, "samples_MB": samples,
            "noise": (max(samples) - min(samples)) / peak if peak > 0 else 0.0}


# ----------------------------------------------------------------------------------------------
# Profiles: where the time goes


def _is_device_row(evt) -> bool:
    return getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA


def _device_us(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total", "device_time_total",
                 "cuda_time_total"):
        value = getattr(evt, attr, 0) or 0
        if value:
            return value
    return 0.0


def profile_rows(run: Callable[[], object], device: str, iters: int) -> list[dict]:
    """key_averages() of `iters` calls of run(), per call: each op's self CPU time and, on a GPU,
    each kernel's device time (rows of kind "kernel"); slowest first."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    run()  # warm: allocator, lazy initialisation
    if device == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(iters):
            run()
        if device == "cuda":
            torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        kernel = _is_device_row(evt)
        us = (_device_us(evt) if kernel else evt.self_cpu_time_total) / iters
        if us > 0:
            rows.append({"name": evt.key, "kind": "kernel" if kernel else "op",
                         "calls": evt.count / iters, "us_per_call": us})
    return sorted(rows, key=lambda r: -r["us_per_call"])


def short_name(name: str, width: int = 70) -> str:
    name = re.sub(r"\(.*\)$", "", name.replace("(anonymous namespace)::", ""))
    return name if len(name) <= width else name[: width - 3] + "..."


# ----------------------------------------------------------------------------------------------
# Targets


def _rows_by(report: dict) -> dict[tuple[str, str, int], dict]:
    return {(r["config"], r["impl"], r["threads"]): r for r in report["results"]}


def _memory_by(report: dict) -> dict[tuple[str, str], dict]:
    return {(m["config"], m["impl"]): m for m in report.get("memory", {}).get("results", [])}


def _noise(t: dict) -> float:
    """A timing's noise, IQR / median (a Timing's, as the report's JSON holds it)."""
    return timing.relative_iqr(t["iqr_us"], t["median_us"])


def target_threads(t: Target | dict, plan_threads: Sequence[int]) -> int:
    """The thread count a speed target is read at: its own, or the most threads timed."""
    threads = t.threads if isinstance(t, Target) else t.get("threads")
    return threads or max(plan_threads)


def _time_value(t: Target, report: dict) -> tuple[float | None, float | None, str]:
    rows, n = _rows_by(report), target_threads(t, report["plan_threads"])
    impl, base = rows.get((t.config, t.impl, n)), rows.get((t.config, t.base, n))
    if impl is None or base is None:
        missing = t.impl if impl is None else t.base
        return None, None, f"{missing} was not measured at {t.config} ({n} threads)"
    phases = report["phases"] if t.phase == "step" else [t.phase]
    t_impl = sum(impl[p]["median_us"] for p in phases)
    t_base = sum(base[p]["median_us"] for p in phases)
    noise = max(_noise(r[p]) for r in (impl, base) for p in phases)
    return (t_base / t_impl if t.kind == "speedup" else t_impl / t_base), noise, ""


def _threads_value(t: Target, report: dict) -> tuple[float | None, float | None, str]:
    counts, rows = report["plan_threads"], _rows_by(report)
    if len(counts) < 2:
        return None, None, f"one thread count timed ({counts[0]})"
    few, many = (rows.get((t.config, t.impl, n)) for n in (min(counts), max(counts)))
    if few is None or many is None:
        return None, None, f"{t.impl} was not measured at {t.config}"
    noise = max(_noise(r[t.phase]) for r in (few, many))
    t_few, t_many = few[t.phase]["median_us"], many[t.phase]["median_us"]
    return t_few / t_many, noise, (f"{t.impl} {PHASE_TITLE[t.phase].lower()}: {t_few:.1f} us on "
                                   f"{min(counts)} thread(s), {t_many:.1f} us on {max(counts)} "
                                   f"(medians); the load average is in the run line above")


def _memory_value(t: Target, report: dict) -> tuple[float | None, float | None, str]:
    memory = _memory_by(report)
    impl, base = memory.get((t.config, t.impl)), memory.get((t.config, t.base))
    for key, m in ((t.impl, impl), (t.base, base)):
        if m is None or "peak_MB" not in m:
            return None, None, (f"no memory measurement of {key} at {t.config}"
                                + (f": {m['error']}" if m else ""))
    if base["peak_MB"] <= 0:
        return None, None, f"{t.base} grew by {base['peak_MB']:.1f} MB: nothing to compare with"
    return impl["peak_MB"] / base["peak_MB"], max(impl["noise"], base["noise"]), (
        f"peak growth of forward + backward: {t.impl} {impl['peak_MB']:.1f} MB, {t.base} "
        f"{base['peak_MB']:.1f} MB")


def evaluate_targets(bench: OpBench, device: str, report: dict) -> list[dict]:
    """Each target with its value, noise and status: met, missed or not evaluated, and `why`: what
    was missing, or the numbers behind the value (a missed speed target's profile replaces it)."""
    value_of = {"speedup": _time_value, "within": _time_value, "threads": _threads_value,
                "memory": _memory_value}
    out = []
    for t in bench.targets(device):
        evaluate = bench.evaluate_custom if t.kind == "custom" else value_of[t.kind]
        value, noise, why = evaluate(t, report)
        row = dict(dataclasses.asdict(t), value=value, noise=noise, why=why)
        if value is None:
            row["status"] = "not evaluated"
        else:
            met = value <= t.threshold if t.at_most else value >= t.threshold
            row["status"] = "met" if met else "missed"
        out.append(row)
    return out


def _sentence(phrase: str) -> str:
    return phrase[:1].upper() + phrase[1:]


def reason_text(target: dict, sides: dict, floor: dict | None, bench: OpBench) -> str:
    """Where the time goes, in Amdahl's terms: the floor's calls (the GEMMs, the convolution's
    arithmetic) are in every implementation, so an implementation can at best remove the rest."""
    impl, base = target["impl"], target["base"]
    phases = list(sides[impl])
    t_impl = sum(sides[impl][p]["median_us"] for p in phases)
    t_base = sum(sides[base][p]["median_us"] for p in phases)
    what = "+".join(phases)
    parts = [f"{what}: {impl} {t_impl:.1f} us, {base} {t_base:.1f} us (medians)."]
    if floor is not None and base != bench.floor:
        t_floor = sum(floor[p]["median_us"] for p in phases)
        parts.append(f"{_sentence(bench.floor_phrase)} alone: {t_floor:.1f} us "
                     f"({t_floor / t_impl:.0%} of {impl}, {t_floor / t_base:.0%} of {base}); "
                     f"the rest costs "
                     f"{t_impl - t_floor:.1f} us in {impl} against {t_base - t_floor:.1f} us in "
                     f"{base}.")
        bound = t_base / t_floor
        if bound < target["threshold"]:
            parts.append(f"Even with everything but {bench.floor_phrase} at zero cost, {impl} "
                         f"would reach only {bound:.2f}x: at this size the target is beyond what "
                         f"the rest can buy; the time is the floor's.")
        else:
            parts.append(f"With everything but {bench.floor_phrase} at zero cost it would reach "
                         f"{bound:.2f}x, so the rest falls short; the profiles below show where "
                         f"it goes.")
    elif base == bench.floor:
        parts.append(f"Beyond {bench.floor_phrase}, {impl} spends {t_impl - t_base:.1f} us; the "
                     f"profiles below show where.")
    if target.get("device") == "cuda":
        busy = sum(sides[impl][p]["profiled_total_us"] for p in phases)
        if busy < 0.5 * t_impl:
            parts.append(f"The GPU is busy only {busy:.1f} us of {t_impl:.1f} us per call: "
                         f"launch-bound, the time is CPU-side dispatch.")
    return " ".join(parts)


# ----------------------------------------------------------------------------------------------
# Running one op on one device


class DeviceRun:
    """One op on one device: every configuration validated, timed and written, then the targets."""

    def __init__(self, bench: OpBench, device: str, plan: Plan, impls: list[Impl],
                 skipped: dict[str, str], out_dir: Path, smoke: bool, log=print):
        self.bench, self.device, self.plan, self.impls = bench, device, plan, impls
        self.out_dir, self.log = out_dir, log
        self.dtype = getattr(torch, plan.dtype)
        self.start = time.perf_counter()
        self.report = new_report(bench, device, plan, impls, skipped, smoke)
        self.load: timing.Load | None = None  # other processes' CPU use while timing, so far

    @property
    def top_threads(self) -> int:
        return max(self.plan.thread_counts())

    def run(self) -> dict:
        measured: dict[tuple, str] = {}  # sizes -> the configuration they were measured as
        for config in self.plan.configs:
            self.report["configs"][config.name] = {"sizes": dict(config.sizes),
                                                   "description": config.describe(),
                                                   "sweep": config.sweep}
            if config.shape_key in measured:
                self.reuse(measured[config.shape_key], config)
            else:
                self.measure(config)
                measured[config.shape_key] = config.name
            self.write(png=False)
        if self.bench.measure_extra:
            self.bench.measure_extra(self)
        self.report["targets"] = evaluate_targets(self.bench, self.device, self.report)
        self.explain_missed()
        self.write(png=True)
        return self.report

    # -- one configuration

    def measure(self, config: Config) -> None:
        self.log(f"\n[bench] {self.bench.op}, {self.device}, {config.name}: {config.describe()}, "
                 f"{self.plan.dtype}")
        sample = self.bench.sample(config, self.device, self.dtype)
        grad_outputs = incoming_gradients(self.bench.spec, sample)
        checks = {}
        for impl in self.impls:
            impl.prepare(config)
            if impl.reference_line:
                checks[impl.key] = None
                continue
            self.record_first_call(impl, config, sample)
            check = validate(impl.fn, self.bench.spec, sample, grad_outputs)
            if check.ok:
                checks[impl.key] = check
            else:
                self.refuse(impl, config, check)
        timed = [i for i in self.impls if i.key in checks]
        rows = self.time(config, sample, grad_outputs, timed, checks)
        add_ratios(rows, self.bench.baselines, self.bench.phases, self.bench.step)
        for row in rows.values():
            self.log("  " + self.line(row))
        self.report["results"] += list(rows.values())
        del sample, grad_outputs
        if config.name in self.plan.memory:
            self.measure_memory(config, timed)
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def record_first_call(self, impl: Impl, config: Config, sample: Sample) -> None:
        """Seconds of the first call here (torch.compile: its compile or cache load)."""
        start = time.perf_counter()
        with contextlib.suppress(Exception):  # validation reports what it raises
            sample.call(impl.fn)
        seconds = round(time.perf_counter() - start, 2)
        self.report["first_call_s"].setdefault(impl.key, {})[config.name] = seconds

    def refuse(self, impl: Impl, config: Config, check: Validation) -> None:
        if check.no_kernel:
            self.log(f"  {impl.label:<34} not run: no kernel for {self.device} ({check.reason})")
            self.report["skipped"][impl.key] = (f"{impl.label}: no {self.device} kernel: "
                                                f"{check.reason}")
            return
        self.log(f"  {impl.label:<34} REFUSED, not timed: {check.reason}")
        self.report["refused"].append({"impl": impl.key, "label": impl.label, "config": config.name,
                                       "reason": check.reason, "errors": check.errors})

    def time(self, config: Config, sample: Sample, grad_outputs, timed: list[Impl],
             checks: dict) -> dict[tuple[str, int], dict]:
        """Rounds over thread counts and implementations; each keeps its lowest round's median.
        Other processes' CPU use is watched meanwhile and added to the run's (self.load)."""
        rows = {(impl.key, n): new_row(impl, config, n, checks[impl.key], self.bench.phases)
                for n in self.plan.thread_counts() for impl in timed}
        with timing.LoadMonitor() as watch:
            for _ in range(self.plan.rounds):
                for n, impl in itertools.product(self.plan.thread_counts(), timed):
                    runners = runners_for(impl, config, self.device, sample, grad_outputs,
                                          self.bench.phases)
                    row = rows[(impl.key, n)]
                    for phase in self.bench.phases:
                        t = time_call(runners[phase], min_run_time=self.plan.min_run_time,
                                      threads=n, min_blocks=self.plan.min_blocks)
                        row["rounds"][phase].append(t.median_us)
                        if phase not in row or t.median_us < row[phase]["median_us"]:
                            row[phase] = t.as_dict()
                    del runners  # a recorded graph holds its buffers
        self.load = watch.load if self.load is None else self.load + watch.load
        return rows

    def reuse(self, first: str, config: Config) -> None:
        """A configuration with the sizes of one already measured: its results, renamed."""
        self.report["results"] += [dict(r, config=config.name) for r in self.report["results"]
                                   if r["config"] == first]
        self.report["refused"] += [dict(r, config=config.name) for r in self.report["refused"]
                                   if r["config"] == first]

    def measure_memory(self, config: Config, timed: list[Impl]) -> None:
        memory = self.report.setdefault("memory", {"method": MEMORY_METHOD[self.device],
                                                   "threads": self.top_threads, "results": []})
        found = measure_memory(self.bench.op, self.device, timed, config, self.plan,
                               self.top_threads)
        for impl in timed:
            result = found[impl.key]
            memory["results"].append({"impl": impl.key, "label": impl.label,
                                      "config": config.name, **result})
            shown = (f"{result['peak_MB']:.1f} MB" if "peak_MB" in result
                     else f"not measured: {result['error']}")
            self.log(f"  {impl.label:<34} peak memory of forward + backward: {shown}")

    def line(self, row: dict) -> str:
        if self.bench.summary_line:
            return self.bench.summary_line(row)
        times = " | ".join(f"{PHASE_TITLE[p]}: {row[p]['median_us']:10.1f} us"
                           for p in self.bench.phases)
        return f"{row['label']:<34} {row['threads']} thr  {times}"

    # -- after the configurations

    def explain_missed(self) -> None:
        """Profile both sides of each missed speed target and say where the time goes."""
        by_key = {i.key: i for i in self.impls}
        rows = _rows_by(self.report)
        for target in self.report["targets"]:
            if target["status"] != "missed" or target["kind"] not in ("speedup", "within"):
                continue
            config = self.plan.config(target["config"])
            phases = self.bench.phases if target["phase"] == "step" else (target["phase"],)
            sample = self.bench.sample(config, self.device, self.dtype)
            grads = incoming_gradients(self.bench.spec, sample)
            sides = {}
            threads = target_threads(target, self.plan.thread_counts())
            with timing.intra_op_threads(threads):
                for key in (target["impl"], target["base"]):
                    by_key[key].prepare(config)
                    runners = runners_for(by_key[key], config, self.device, sample, grads, phases)
                    row = rows[(config.name, key, threads)]
                    sides[key] = {p: self.profile(runners[p], row[p]["median_us"]) for p in phases}
            floor = rows.get((config.name, self.bench.floor, threads))
            target["profile"] = sides
            target["why"] = reason_text(dict(target, device=self.device), sides, floor, self.bench)
            self.log(f"\n[bench] missed: {target['name']} ({target['config']}): {target['why']}")

    def profile(self, run: Callable[[], object], median_us: float) -> dict:
        rows = profile_rows(run, self.device, self.plan.profile_iters)
        kind = "kernel" if self.device == "cuda" else "op"
        return {"median_us": median_us,
                "profiled_total_us": sum(r["us_per_call"] for r in rows if r["kind"] == kind),
                "top": [dict(r, name=short_name(r["name"])) for r in rows[:8]]}

    def verdict(self) -> timing.Verdict | None:
        """The verdict on every timing so far: other processes' load while timing (the timing
        rounds only: not validation, compiling or memory probes), each timing's noise."""
        if self.load is None:
            return None
        return timing.Verdict.judge(self.load, {
            f"{r['label']} {PHASE_SHORT[p]} ({r['config']}, {r['threads']} thr)": _noise(r[p])
            for r in self.report["results"] for p in self.bench.phases if p in r})

    def write(self, png: bool) -> dict[str, Path]:
        verdict = self.verdict()
        if verdict is not None:
            self.report["verdict"] = verdict.as_dict()
        self.report["load_after"] = load_average()
        self.report["wall_s"] = time.perf_counter() - self.start
        return write_report(self.out_dir, self.report, self.bench, png=png)


def new_row(impl: Impl, config: Config, threads: int, check: Validation | None,
            phases: Sequence[str]) -> dict:
    """A result row; the timings (per phase: the lowest round's Timing) are added as measured."""
    row = {"impl": impl.key, "label": impl.label, "config": config.name, **config.sizes,
           "threads": threads, "reference_line": impl.reference_line,
           "validated": check is not None, "rounds": {p: [] for p in phases}}
    if check is not None:
        row.update(max_relative_error=check.worst, errors=check.errors)
    return row


def new_report(bench: OpBench, device: str, plan: Plan, impls: list[Impl],
               skipped: dict[str, str], smoke: bool) -> dict:
    dtype = getattr(torch, plan.dtype)
    rtol, atol = bench.spec.tolerance(dtype)
    return {
        "op": bench.op, "title": bench.title, "machine": machine_info(device, plan),
        "smoke": smoke, "commit": git_commit(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "plan": dataclasses.asdict(plan), "plan_threads": list(plan.thread_counts()),
        "dtype": str(dtype), "phases": list(bench.phases), "baselines": list(bench.baselines),
        "tolerance": {"rtol": rtol, "atol": atol},
        "implementations": {i.key: i.label for i in impls},
        "notes": {i.key: i.note for i in impls if i.note},
        "skipped": dict(skipped), "configs": {}, "results": [], "refused": [],
        "first_call_s": {}, "targets": [],
        "load_before": load_average(), "load_after": load_average(), "wall_s": 0.0,
    }


# ----------------------------------------------------------------------------------------------
# Machine


def machine_info(device: str, plan: Plan) -> dict:
    threads = max(plan.thread_counts())
    info = {
        "device": device, "description": timing.describe_machine(device),
        # One report per device, thread count and dtype: cpu-2threads, nvidia-h200,
        # cpu-2threads-bfloat16 (float32, the default, is not named).
        "slug": (f"cpu-{threads}threads" if device == "cpu" else timing.machine_slug(device))
        + ("" if plan.dtype == "float32" else f"-{plan.dtype}"),
        "torch": torch.__version__, "python": platform.python_version(),
        "threads": threads, "thread_counts": list(plan.thread_counts()), "cores": os.cpu_count(),
        "cpu": cpu_model(), "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_GiB=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, capability=f"{props.major}.{props.minor}")
    return info


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def warn_if_busy(log=print) -> None:
    """Two OpenMP threads on two busy cores wait on each other for milliseconds per op: a short
    look at other processes' load before the run (the run watches it while timing, too)."""
    load = timing.probe()
    if load.busy_machine:
        log(f"[bench] WARNING: in a {load.seconds:.1f} s look, {load.describe()}: the timings "
            f"will be unreliable, and the report will say so (see bench/README.md)")


# ----------------------------------------------------------------------------------------------
# Report: JSON, Markdown, PNG


def write_report(out_dir: Path, report: dict, bench: OpBench, *, png: bool = True,
                 json_too: bool = True) -> dict[str, Path]:
    """<slug>.json, .md (and .png) in out_dir. A hand-written <slug>.notes.md there (the reading of
    a committed run) is appended to the .md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = report["machine"]["slug"]
    paths = {ext: out_dir / f"{slug}.{ext}" for ext in ("json", "md", "png")}
    if json_too:
        paths["json"].write_text(json.dumps(report, indent=1) + "\n")
    if png:
        plot(report, paths["png"])
    notes = out_dir / f"{slug}.notes.md"
    paths["md"].write_text(markdown(report, bench, paths["png"].name)
                           + (f"\n{notes.read_text()}" if notes.is_file() else ""))
    return paths


def render(json_path: Path) -> dict[str, Path]:
    """Rebuild the .md and .png of a report from its .json (which is left as it is). The op is the
    report's `op`, or for older reports the folder's name (bench/results/<op>/)."""
    report = json.loads(json_path.read_text())
    bench = load_op(report.get("op") or json_path.parent.name)
    if bench.upgrade:
        report = bench.upgrade(report)
    return write_report(json_path.parent, report, bench, json_too=False)


def _ratio_cell(row: dict, base: str, phases: Sequence[str]) -> str:
    r = row.get(f"vs_{base}")
    return " / ".join(f"{r[p]:.2f}x" for p in phases) if r else "-"


def _tolerance_text(report: dict) -> str:
    tol = report["tolerance"]
    if "rtol" in tol:
        return (f"at the descriptor's {report['dtype'].removeprefix('torch.')} tolerance: "
                f"|error| <= atol * max(1, max |reference|) + rtol * |reference| elementwise, "
                f"rtol {tol['rtol']:.0e}, atol {tol['atol']:.0e}")
    return f"relative error <= {tol['max_relative_error']:.0e}"


def _header(report: dict) -> list[str]:
    m, plan = report["machine"], report["plan"]
    counts = report["plan_threads"]
    threads = (f"**{m['threads']} intra-op threads**" if len(counts) == 1 else
               f"**{' and '.join(map(str, counts))} intra-op threads, interleaved**")
    lines = [f"# {report['title']}: {m['description']}", ""]
    if report["smoke"]:
        lines += ["**Smoke run: tiny sizes and few iterations; the numbers mean nothing.**", ""]
    verdict = report.get("verdict")
    if verdict and not verdict["reliable"]:
        lines += [f"**{_sentence(timing.Verdict.from_dict(verdict).summary())}.**", ""]
    lines += [
        f"- machine: `{m['slug']}`; {m['cpu']}, {m['cores']} cores; torch {m['torch']}; {threads}"
        + (f"; {m['gpu']} (CUDA {m['cuda']})" if m["device"] == "cuda" else ""),
        (f"- run: {report['date']}, commit {report['commit']}, load average "
         f"{report['load_before']} before, {report['load_after']} after, "
         f"{report['wall_s']:.0f} s"),
        _load_line(verdict),
        f"- {report['dtype'].removeprefix('torch.')}; "
        + ", ".join(PHASE_METHOD[p] for p in report["phases"])
        + f"; medians of torch.utils.benchmark blocks over at least {plan['min_run_time']} s, in "
        f"{plan['rounds']} round(s) interleaved over the implementations"
        + (" and thread counts" if len(counts) > 1 else "")
        + ", the lowest round's median kept; ratios are baseline time / implementation time "
        "(above 1: faster than the baseline)",
        (f"- every implementation was checked against the float64 reference first (outputs and "
         f"all input gradients, {_tolerance_text(report)}); refused ones are listed, not timed"),
    ]
    for key, note in report["notes"].items():
        calls = report["first_call_s"].get(key, {})
        lines.append(f"- {report['implementations'].get(key, key)}: {note}; first call per "
                     f"configuration: " + ", ".join(f"{k} {v} s" for k, v in calls.items()))
    return lines + [""]


def _load_line(verdict: dict | None) -> str:
    """While timing: the verdict (its reasons; the bold line above says what an unreliable one
    means), or "not measured" for reports from before the harness watched the load."""
    if verdict is None:
        return ("- other processes' CPU use while timing: not measured (the load averages above "
                "are all this report has)")
    v = timing.Verdict.from_dict(verdict)
    return (f"- while timing: {v.load.describe()} (busy from {verdict['limits']['busy_cores']} "
            f"core); {len(v.noisy)} of {v.timings} timings noisier than "
            f"{verdict['limits']['noise']:.0%} (IQR / median)")


def _config_tables(report: dict, bench: OpBench) -> list[str]:
    phases, baselines = report["phases"], report["baselines"]
    counts = report["plan_threads"]
    lines = []
    for name, config in report["configs"].items():
        if config["sweep"]:
            continue
        lines += [f"## {name}: {config['description']}", ""]
        for n in counts:
            rows = [r for r in report["results"] if r["config"] == name and r["threads"] == n]
            if not rows:
                continue
            if len(counts) > 1:
                lines += [f"### {n} thread{'s' * (n != 1)}", ""]
            lines += _results_table(rows, phases, baselines)
            if bench.summary_line:
                lines += ["```"] + [bench.summary_line(r) for r in rows
                                    if not r["reference_line"]] + ["```", ""]
    return lines


def _results_table(rows: list[dict], phases: Sequence[str], baselines: Sequence[str]) -> list[str]:
    short = " / ".join(PHASE_SHORT[p] for p in phases)
    lines = ["| implementation | " + " | ".join(PHASE_TITLE[p] for p in phases) + " | "
             + " | ".join(f"vs {b} ({short})" for b in baselines) + " | max rel. error |",
             "|---|" + "--:|" * (len(phases) + len(baselines) + 1)]
    for r in sorted(rows, key=lambda r: r["reference_line"]):
        times = [f"{r[p]['median_us']:.1f} us" for p in phases]
        if r["reference_line"]:
            lines.append(f"| *{r['label']}* | " + " | ".join(f"*{t}*" for t in times) + " |"
                         + " |" * (len(baselines) + 1))
            continue
        lines.append(f"| {r['label']} | " + " | ".join(times) + " | "
                     + " | ".join(_ratio_cell(r, b, phases) for b in baselines)
                     + f" | {r['max_relative_error']:.1e} |")
    return lines + [""]


def _sweep_rows(report: dict) -> list[dict]:
    return [r for r in report["results"] if report["configs"][r["config"]]["sweep"]]


def _sweep_section(report: dict, png_name: str) -> list[str]:
    sweep = _sweep_rows(report)
    if not sweep:
        return []
    key = report["configs"][sweep[0]["config"]]["sweep"]
    fixed = {k: v for k, v in report["configs"][sweep[0]["config"]]["sizes"].items() if k != key}
    labels = list(dict.fromkeys(r["label"] for r in sweep if not r["reference_line"]))
    cell = {(r["label"], r[key]): r for r in sweep}
    phases = report["phases"]
    lines = [f"## Sweep over {key} size: {describe_sizes(fixed)}", "", f"![sweep]({png_name})", "",
             " / ".join(PHASE_TITLE[p].lower() for p in phases).capitalize() + " median, us:", "",
             f"| {key} | " + " | ".join(labels) + " |", "|--:|" + "--:|" * len(labels)]
    for x in sorted({r[key] for r in sweep}):
        values = [cell.get((label, x)) for label in labels]
        lines.append(f"| {x} | " + " | ".join(
            " / ".join(f"{v[p]['median_us']:.1f}" for p in phases) if v else "-"
            for v in values) + " |")
    return lines + [""]


def _memory_section(report: dict) -> list[str]:
    memory = report.get("memory")
    if not memory:
        return []
    base = report["baselines"][0] if report["baselines"] else None
    peaks = {(m["config"], m["impl"]): m.get("peak_MB") for m in memory["results"]}
    lines = ["## Peak memory of forward + backward", "",
             (f"Method: {memory['method']}; {memory['threads']} threads. Noise: the spread of "
              f"repeated measurements over their median."), "",
             f"| configuration | implementation | peak growth | vs {base} | noise |",
             "|---|---|--:|--:|--:|"]
    for m in memory["results"]:
        if "peak_MB" not in m:
            lines.append(f"| {m['config']} | {m['label']} | not measured: {m['error']} | | |")
            continue
        b = peaks.get((m["config"], base))
        ratio = f"{m['peak_MB'] / b:.2f}x" if b else "-"
        lines.append(f"| {m['config']} | {m['label']} | {m['peak_MB']:.1f} MB | {ratio} | "
                     f"{m['noise']:.0%} |")
    return lines + [""]


def _target_cells(t: dict) -> tuple[str, str]:
    if t["kind"] == "custom":  # a fraction (LLTM: of copy bandwidth)
        value = "-" if t["value"] is None else f"{t['value']:.0%}"
        return value, f"{t['threshold']:.0%}"
    value = "-" if t["value"] is None else f"{t['value']:.2f}x"
    return value, ("<= " if t["kind"] in ("within", "memory") else "") + f"{t['threshold']:.2f}x"


# How each kind of target is measured, for the report.
TARGET_READING = {
    "speedup": "*speedup*: baseline time / implementation time (at least the threshold)",
    "within": "*within*: implementation time / baseline time (at most the threshold)",
    "threads": "*threads*: time at the fewest threads / time at the most",
    "memory": "*memory*: peak growth / the baseline's (at most the threshold)",
    "custom": "a percentage: a fraction of a yardstick (the copy's bandwidth)",
}


def _targets_section(report: dict) -> list[str]:
    kinds = dict.fromkeys(t["kind"] for t in report["targets"])
    own = any(t.get("threads") for t in report["targets"])  # a target read at its own count
    reading = ("Measured, at the most threads timed"
               + (" unless a target names its thread count" if own else "") + ": "
               + "; ".join(TARGET_READING[k] for k in kinds)
               + ". Noise: the largest IQR / median among the timings compared"
               + (" (memory: the spread of repeats)" if "memory" in kinds else "") + ".")
    lines = ["## Targets", "", reading, "",
             "| target | config | measured | threshold | noise | status |",
             "|---|---|--:|--:|--:|---|"]
    for t in report["targets"]:
        value, threshold = _target_cells(t)
        noise = f"{t['noise']:.0%}" if t.get("noise") is not None else "-"
        lines.append(f"| {t['name']} | {t['config']} | {value} | {threshold} | {noise} | "
                     f"**{t['status']}** |")
    lines.append("")
    for t in report["targets"]:
        if t["status"] == "met":
            continue
        lines += [f"### {t['status']}: {t['name']} ({t['config']})", "", t.get("why", ""), ""]
        for key, phases in t.get("profile", {}).items():
            for phase, prof in phases.items():
                lines += [(f"{key}, {phase}: median {prof['median_us']:.1f} us; profile top "
                           f"(self time per call, profiler overhead included):"), "",
                          "| op / kernel | kind | calls | us per call |", "|---|---|--:|--:|"]
                lines += [f"| `{r['name']}` | {r['kind']} | {r['calls']:g} | "
                          f"{r['us_per_call']:.1f} |" for r in prof["top"]]
                lines.append("")
    return lines


def markdown(report: dict, bench: OpBench, png_name: str) -> str:
    lines = _header(report) + _config_tables(report, bench) + _sweep_section(report, png_name)
    if not _sweep_rows(report):
        lines += [f"![times]({png_name})", ""]
    lines += _memory_section(report)
    if bench.markdown_extra:
        lines += bench.markdown_extra(report)
    lines += _targets_section(report)
    if report["refused"]:
        lines += ["## Refused (failed validation, not timed)", ""]
        lines += [f"- {r['label']} at {r['config']}: {r['reason']}" for r in report["refused"]]
        lines.append("")
    if report["skipped"]:
        lines += ["## Not run here", ""]
        lines += [f"- {k}: {v}" for k, v in report["skipped"].items()]
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """A sweep: time and speedup over the first baseline against the swept size. Otherwise: each
    configuration's medians per implementation, one panel per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = report["phases"]
    fig, _ = (_plot_sweep if _sweep_rows(report) else _plot_bars)(report, phases, plt)
    m = report["machine"]
    fig.suptitle(f"{report['title']}, {report['dtype'].removeprefix('torch.')} - "
                 f"{m['description']}" + (" (SMOKE)" if report["smoke"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_sweep(report: dict, phases: Sequence[str], plt):
    sweep = _sweep_rows(report)
    key = report["configs"][sweep[0]["config"]]["sweep"]
    base = report["baselines"][0] if report["baselines"] else None
    fig, axes = plt.subplots(2, len(phases), figsize=(5.5 * len(phases), 8), sharex=True,
                             squeeze=False)
    for label in dict.fromkeys(r["label"] for r in sweep):
        rows = sorted((r for r in sweep if r["label"] == label), key=lambda r: r[key])
        line = ({"color": "black", "ls": "--", "lw": 1} if rows[0]["reference_line"]
                else {"marker": "o"})
        for col, phase in enumerate(phases):
            axes[0, col].plot([r[key] for r in rows], [r[phase]["median_us"] for r in rows],
                              label=label, **line)
            if not rows[0]["reference_line"]:
                axes[1, col].plot([r[key] for r in rows],
                                  [r.get(f"vs_{base}", {}).get(phase, math.nan) for r in rows],
                                  marker="o", label=label)
    for col, phase in enumerate(phases):
        axes[0, col].set_title(f"{PHASE_TITLE[phase].lower()}: median time")
        axes[0, col].set_ylabel("us per call")
        axes[0, col].set_yscale("log")
        axes[1, col].set_title(f"{PHASE_TITLE[phase].lower()}: speedup over {base}")
        axes[1, col].set_ylabel(f"{base} time / time")
        axes[1, col].axhline(1.0, color="gray", lw=0.8)
        axes[1, col].set_xlabel(f"{key} size")
        for row in range(2):
            axes[row, col].set_xscale("log", base=2)
            axes[row, col].grid(True, which="both", alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    return fig, axes


def _plot_bars(report: dict, phases: Sequence[str], plt):
    """One panel per phase (columns) and thread count (rows): bars per configuration and
    implementation, reference lines hatched."""
    counts = report["plan_threads"]
    configs = list(report["configs"])
    labels = list(dict.fromkeys(r["label"] for r in report["results"]))
    cell = {(r["config"], r["label"], r["threads"]): r for r in report["results"]}
    reference = {r["label"] for r in report["results"] if r["reference_line"]}
    width = 0.8 / max(len(labels), 1)
    fig, axes = plt.subplots(len(counts), len(phases), figsize=(6 * len(phases), 4 * len(counts)),
                             squeeze=False)
    for row, n in enumerate(counts):
        for col, phase in enumerate(phases):
            ax = axes[row, col]
            for k, label in enumerate(labels):
                ms = [cell[(c, label, n)][phase]["median_us"] / 1e3 if (c, label, n) in cell
                      else math.nan for c in configs]
                ax.bar([i + k * width for i in range(len(configs))], ms, width, label=label,
                       hatch="//" if label in reference else None,
                       alpha=0.6 if label in reference else 1.0)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))], configs)
            ax.set_yscale("log")
            ax.set_ylabel("ms per call (median)")
            ax.set_title(f"{PHASE_TITLE[phase]}, {n} thread{'s' * (n != 1)}")
            ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0, -1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    return fig, axes


# ----------------------------------------------------------------------------------------------
# One op, every device asked for


def run_op(bench: OpBench, devices: Sequence[str], loaded: Mapping[int, Any], *, smoke: bool,
           out_root: Path, min_run_time: float | None = None, dtype: str | None = None,
           log=print) -> int:
    """Run `bench` on each device, in `dtype` (one of DTYPES; None: the plan's); 1 when an
    implementation was refused, else 0."""
    status = 0
    for device in devices:
        plan = bench.plan(device, smoke)
        if min_run_time:
            plan = dataclasses.replace(plan, min_run_time=min_run_time)
        if dtype:
            plan = dataclasses.replace(plan, dtype=dtype)
        stage_impls, skipped = stage_implementations(bench.op, device, loaded)
        impls = bench.implementations(device) + stage_impls
        log(f"\n[bench] ===== {bench.op} on {timing.describe_machine(device)}, thread counts "
            f"{', '.join(map(str, plan.thread_counts()))}; implementations: "
            f"{', '.join(i.key for i in impls)}")
        for key, reason in skipped.items():
            log(f"[bench] {key} not run: {reason}")
        run = DeviceRun(bench, device, plan, impls, skipped, out_root / bench.op, smoke, log)
        report = run.run()
        log(f"\n[bench] {bench.op} targets ({device}):")
        for t in report["targets"]:
            value, threshold = _target_cells(t)
            log(f"  {t['status']:<13} {t['name']} ({t['config']}): {value} (threshold "
                f"{threshold})" + (f": {t['why']}" if t["status"] == "not evaluated" else ""))
        if "verdict" in report:
            log(f"[bench] {bench.op} on {device}: {report['verdict']['summary']}")
        slug = report["machine"]["slug"]
        log(f"[bench] wrote {out_root / bench.op}/{slug}.{{json,md,png}}")
        if report["refused"]:
            status = 1
    return status
