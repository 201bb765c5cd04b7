"""The LLTM benchmark: every stage against plain PyTorch and torch.compile, on the CPU and the GPU.

Run card
  full:   make bench                    (or: python bench/lltm_bench.py, common/ on PYTHONPATH)
          writes bench/results/<machine>.{json,md,png}, one set per device (cpu-2threads, nvidia-h200)
  smoke:  python bench/lltm_bench.py --smoke --out build/bench-smoke
          few iterations, tiny sizes: checks that the benchmark works (tests/test_bench.py runs it)
  flags:  --device cpu|cuda|all   --threads N   --min-run-time S

What it does, per device, per configuration (the tutorial's, a large one, a sweep over state size):
  1. validate: every implementation's outputs and input gradients against the float64 reference
     (workbook.reference.lltm); one that mismatches or raises is refused, reported, never timed;
  2. time: forward and backward apart, medians of torch.utils.benchmark blocks (it synchronizes
     CUDA around each block), as in the tutorial's `Forward: X us | Backward: Y us`;
  3. compare: ratios against plain PyTorch (eager) and against torch.compile of the same code;
  4. on a GPU: the fused pointwise kernels' bandwidth against a device-to-device copy, both timed
     from torch.profiler kernel records in the same run;
  5. targets: met or missed, and for a missed one a profile that says where the time goes.

Implementations are discovered through workbook.build: every stage whose package has `lltm` runs
where its kernels run (CUDA-only stages on the GPU; stage 05 on both). A stage that is absent, or
that this machine cannot build, is listed with the reason and the rest still runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "common") not in sys.path:
    sys.path.insert(0, str(REPO / "common"))

from workbook import build  # noqa: E402  (imports no torch)

# Inductor's generated C++/Triton and its caches go under build/, like every other build output.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(build.build_root() / "inductor"))

import torch  # noqa: E402

from workbook import reference, timing  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Configurations


@dataclasses.dataclass(frozen=True)
class Config:
    name: str  # "tutorial", "large", "sweep-s256"
    batch: int
    features: int
    state: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.batch, self.features, self.state)

    def describe(self) -> str:
        return f"batch {self.batch}, features {self.features}, state {self.state}"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one device runs: the tutorial's configuration, a large one, and a state-size sweep."""

    tutorial: Config
    large: Config
    sweep_batch: int
    sweep_features: int
    sweep_states: tuple[int, ...]
    min_run_time: float  # seconds per torch.utils.benchmark measurement
    profile_iters: int  # calls per torch.profiler window
    # Timing rounds, interleaved over the implementations; the round with the lowest median
    # counts. On a shared machine a burst of other work then spoils one round of everyone
    # instead of every round of one implementation.
    rounds: int = 1

    def configs(self) -> list[Config]:
        sweep = [Config(f"sweep-s{s}", self.sweep_batch, self.sweep_features, s)
                 for s in self.sweep_states]
        return [self.tutorial, self.large, *sweep]


TUTORIAL = Config("tutorial", 16, 32, 128)  # the sizes the PyTorch C++ extension tutorial times

PLANS = {
    # CPU large: a GEMM of 256 x 2560 x 6144 (8 GFLOP forward) against 0.5M pointwise elements.
    ("cpu", False): Plan(TUTORIAL, Config("large", 256, 512, 2048), 16, 32,
                         (32, 64, 128, 256, 512, 1024, 2048), min_run_time=0.4, profile_iters=20,
                         rounds=3),
    # GPU large: B x S = 16.8M elements, so the fused kernels move 400 MB forward, 670 MB
    # backward, far past the 60 MB L2: their time is HBM time, comparable with a copy's.
    ("cuda", False): Plan(TUTORIAL, Config("large", 4096, 512, 4096), 1024, 32,
                          (128, 256, 512, 1024, 2048, 4096, 8192), min_run_time=0.3,
                          profile_iters=20, rounds=1),
    # Smoke: two distinct shapes (the sweep's are the tutorial's and the large one's), so
    # torch.compile compiles twice per device.
    ("cpu", True): Plan(TUTORIAL, Config("large", 16, 32, 256), 16, 32, (128, 256),
                        min_run_time=0.02, profile_iters=3),
    ("cuda", True): Plan(TUTORIAL, Config("large", 16, 32, 1024), 16, 32, (128, 1024),
                         min_run_time=0.02, profile_iters=3),
}

DTYPE = torch.float32
# Largest |error| / max|reference| allowed per output and per input gradient. float32 GEMMs over
# a few thousand terms land near 1e-6; a real bug (a swapped gate, a missing term) lands > 1e-3.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}

OUTPUT_NAMES = ("new_h", "new_cell")
INPUT_NAMES = ("input", "weights", "bias", "old_h", "old_cell")

# Bytes per (batch, state) element of the fused pointwise kernels, restated from the comments
# next to the kernels (stages/0{4,5}_*/csrc/lltm_cuda.cu):
#   forward:  reads gates (3 values) + old_cell (1); writes new_h + new_cell (2): 6 values
#   backward: reads grad_h, grad_cell, new_cell, gates (3): 6; writes d_gates (3), d_old_cell (1): 4
# times the element size (4 B in float32): 24 B forward, 40 B backward.
FORWARD_VALUES_PER_ELEMENT = 6
BACKWARD_VALUES_PER_ELEMENT = 10

# Ops and kernels that are the GEMMs of the cell (the same in every implementation).
GEMM_OPS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::_addmm_activation")
GEMM_KERNEL = re.compile(r"gemm|gemv|cutlass|xmma|nvjet|sm\d+_|cublas", re.IGNORECASE)


# ----------------------------------------------------------------------------------------------
# Implementations


@dataclasses.dataclass
class Impl:
    key: str  # "eager", "compile", "stage05"
    label: str
    fn: Callable
    prepare: Callable[[Config], None] = lambda config: None  # before each configuration
    note: str = ""


class CompiledReference:
    """torch.compile of the plain PyTorch cell, compiled afresh for every configuration.

    Static shapes (dynamic=False) and fullgraph=True: the best case for torch.compile, what a
    user with fixed sizes gets. `torch._dynamo.reset()` per configuration keeps the sweep from
    running into the recompile limit; inductor's on-disk cache (under build/) makes a second run
    fast. Donated buffers are off: they forbid the retain_graph=True replay the backward timing
    uses (and save memory, not time).
    """

    settings = "torch.compile(reference.lltm, dynamic=False, fullgraph=True), default mode"

    def __init__(self) -> None:
        import torch._functorch.config as functorch_config

        if hasattr(functorch_config, "donated_buffer"):
            functorch_config.donated_buffer = False
        self.compiled = None
        self.first_call_s: dict[str, float] = {}

    def prepare(self, config: Config) -> None:
        torch._dynamo.reset()
        self.compiled = torch.compile(reference.lltm, dynamic=False, fullgraph=True)

    def __call__(self, *inputs):
        return self.compiled(*inputs)


def runs_on(s: build.Stage) -> tuple[str, ...]:
    """Where a stage's kernels run: CUDA-only stages on the GPU, the others on the CPU too."""
    if s.cuda:
        return ("cpu", "cuda") if s.cpu_fallback else ("cuda",)
    return ("cpu",)


def discover(devices: list[str]) -> tuple[dict[int, object], dict[str, str]]:
    """Import every LLTM stage that runs on one of `devices`; returns (modules, skipped reasons)."""
    modules, skipped = {}, {}
    for s in build.STAGES.values():
        if not s.package.startswith("lltm"):  # stage 01 (z2xy) is not an LLTM
            continue
        key = f"stage{s.number:02d}"
        where = [d for d in runs_on(s) if d in devices]
        if not s.source_dir.is_dir():
            skipped[key] = f"{s.folder}: not in this checkout"
            continue
        if not where:
            why = ("no GPU visible here" if "cuda" in runs_on(s) and not torch.cuda.is_available()
                   else f"this run benchmarks {'/'.join(devices) or 'no device'}")
            skipped[key] = f"{s.folder}: runs on {'/'.join(runs_on(s))} only; {why}"
            continue
        try:
            module = build.import_stage(s.number)
        except build.StageSkipped as reason:
            skipped[key] = str(reason)
            continue
        except Exception as error:  # a stage that does not build is reported, not fatal
            skipped[key] = f"{s.folder}: failed to build or import: {type(error).__name__}: " + \
                str(error).splitlines()[0]
            continue
        if hasattr(module, "lltm"):
            modules[s.number] = module
    return modules, skipped


def implementations(device: str, modules: dict[int, object]) -> list[Impl]:
    compiled = CompiledReference()
    impls = [
        Impl("eager", "plain PyTorch (eager)", reference.lltm),
        Impl("compile", "plain PyTorch + torch.compile", compiled, compiled.prepare,
             note=compiled.settings),
    ]
    for number, module in sorted(modules.items()):
        s = build.stage(number)
        if device in runs_on(s):
            impls.append(Impl(f"stage{number:02d}", f"stage {s.folder}", module.lltm))
    return impls


# ----------------------------------------------------------------------------------------------
# Inputs and validation


def make_inputs(config: Config, device: str, dtype=DTYPE, seed: int = 0):
    """(input, weights, bias, old_h, old_cell) with weights in the module's +-1/sqrt(S) range."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bound = config.state ** -0.5
    b, f, s = config.shape

    def make(*shape, scale=1.0):
        t = torch.rand(shape, generator=gen, device=device, dtype=dtype) * 2 - 1
        return (t * scale).requires_grad_()

    return (make(b, f), make(3 * s, f + s, scale=bound), make(3 * s, scale=bound),
            make(b, s), make(b, s))


def make_grad_outputs(config: Config, device: str, dtype=DTYPE, seed: int = 1):
    """Random incoming gradients for (new_h, new_cell): ones would let swapped gradients pass."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.rand(config.batch, config.state, generator=gen, device=device,
                            dtype=dtype) * 2 - 1 for _ in OUTPUT_NAMES)


@dataclasses.dataclass
class Reference:
    outputs: tuple[torch.Tensor, ...]
    grads: tuple[torch.Tensor, ...]


def float64_reference(inputs, grad_outputs) -> Reference:
    x64 = reference.in_float64(*inputs)
    outputs = reference.lltm(*x64)
    grads = torch.autograd.grad(outputs, x64, [g.double() for g in grad_outputs])
    return Reference(tuple(o.detach() for o in outputs), tuple(grads))


@dataclasses.dataclass
class Validation:
    ok: bool
    errors: dict[str, float]  # max |error| / max |reference|, per output and input gradient
    reason: str = ""


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return ((actual.detach().double() - expected).abs().max() / scale).item()


def validate(fn: Callable, inputs, grad_outputs, ref: Reference, tol: float | None = None) -> Validation:
    """Run fn forward and backward on `inputs` and compare with the float64 reference.

    Refuses (ok=False, with the reason) an implementation that raises, returns the wrong number,
    shape or dtype of tensors, gives no gradient for an input, or is off by more than `tol`
    relative to the reference's largest value (NaN counts as off).
    """
    dtype = inputs[0].dtype
    tol = TOLERANCE[dtype] if tol is None else tol
    try:
        outputs = fn(*inputs)
        outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
        if len(outputs) != len(OUTPUT_NAMES):
            return Validation(False, {}, f"returned {len(outputs)} tensors, expected 2 "
                                         f"({', '.join(OUTPUT_NAMES)})")
        grads = torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)
    except Exception as error:
        return Validation(False, {}, f"raised {type(error).__name__}: {str(error).splitlines()[0]}")
    errors, problems = {}, []
    names = OUTPUT_NAMES + tuple(f"grad {n}" for n in INPUT_NAMES)
    for name, actual, expected in zip(names, outputs + tuple(grads), ref.outputs + ref.grads):
        if actual is None:
            problems.append(f"{name}: no gradient")
            continue
        if actual.shape != expected.shape or actual.dtype != dtype:
            problems.append(f"{name}: got {actual.dtype} {tuple(actual.shape)}, "
                            f"expected {dtype} {tuple(expected.shape)}")
            continue
        errors[name] = relative_error(actual, expected)
        if not errors[name] <= tol:  # written so that NaN fails
            problems.append(f"{name}: relative error {errors[name]:.1e} > {tol:.0e}")
    return Validation(not problems, errors, "; ".join(problems))


# ----------------------------------------------------------------------------------------------
# Running one device


def run_device(device: str, plan: Plan, impls: list[Impl], *, log=print) -> dict:
    """Validate and time every implementation at every configuration of the plan on `device`.

    Returns the device's section of the report: the configurations, one entry per
    (implementation, configuration) with its validation and timings, and the refusals.
    """
    results, refused, compile_s, floors = [], [], {}, {}
    measured: dict[tuple, tuple] = {}  # shape -> (config, {impl: entry}, refusals): reused
    for config in plan.configs():
        if config.shape in measured:
            first, entries, refusals = measured[config.shape]
            results += [dict(entry, config=config.name) for entry in entries.values()]
            refused += [dict(r, config=config.name) for r in refusals]
            floors[config.name] = floors[first]
            continue
        log(f"\n[bench] {device}, {config.name}: {config.describe()}, {DTYPE}")
        inputs = make_inputs(config, device)
        grad_outputs = make_grad_outputs(config, device)
        ref = float64_reference(inputs, grad_outputs)
        entries, valid = {}, []
        for impl in impls:
            impl.prepare(config)
            start = time.perf_counter()
            check = validate(impl.fn, inputs, grad_outputs, ref)
            first_call = time.perf_counter() - start
            if impl.key == "compile":
                compile_s[config.name] = round(first_call, 2)
            if not check.ok:
                log(f"  {impl.label:<34} REFUSED, not timed: {check.reason}")
                refused.append({"impl": impl.key, "label": impl.label, "config": config.name,
                                "reason": check.reason, "errors": check.errors})
                continue
            valid.append(impl)
            entries[impl.key] = {
                "impl": impl.key, "label": impl.label, "config": config.name,
                "batch": config.batch, "features": config.features, "state": config.state,
                "validated": True, "max_relative_error": max(check.errors.values()),
                "errors": check.errors, "rounds": {"forward": [], "backward": []},
            }
        for _ in range(plan.rounds):
            for impl in valid:  # torch.compile's graph for this shape was compiled above
                entry = entries[impl.key]
                for phase, t in zip(("forward", "backward"), timing.forward_backward(
                        impl.fn, inputs, grad_outputs=grad_outputs,
                        min_run_time=plan.min_run_time)):
                    entry["rounds"][phase].append(t.median_us)
                    if phase not in entry or t.median_us < entry[phase]["median_us"]:
                        entry[phase] = t.as_dict()
        add_ratios(entries)
        for entry in entries.values():
            log("  " + tutorial_line(entry))
            results.append(entry)
        floors[config.name] = gemm_floor(config, device, plan.min_run_time, plan.rounds)
        log(f"  {'(GEMMs alone: the floor)':<34} Forward: "
            f"{floors[config.name]['forward']['median_us']:9.1f} us | Backward: "
            f"{floors[config.name]['backward']['median_us']:9.1f} us")
        measured[config.shape] = (config.name, entries,
                                  [r for r in refused if r["config"] == config.name])
        del inputs, grad_outputs, ref
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"results": results, "refused": refused, "compile_first_call_s": compile_s,
            "gemm_floor": floors}


def add_ratios(entries: dict[str, dict]) -> None:
    """Speedups: baseline time / implementation time (above 1: the implementation is faster)."""
    for entry in entries.values():
        for base in ("eager", "compile"):
            if base in entries:
                b = entries[base]
                entry[f"vs_{base}"] = {
                    phase: b[phase]["median_us"] / entry[phase]["median_us"]
                    for phase in ("forward", "backward")
                }
                entry[f"vs_{base}"]["step"] = step_us(b) / step_us(entry)


def step_us(entry: dict) -> float:
    return entry["forward"]["median_us"] + entry["backward"]["median_us"]


def ratio_text(entry: dict, base: str) -> str:
    r = entry.get(f"vs_{base}")
    return f"{r['forward']:.2f}x | {r['backward']:.2f}x" if r else "-"


def tutorial_line(entry: dict) -> str:
    return (f"{entry['label']:<34} Forward: {entry['forward']['median_us']:9.1f} us | "
            f"Backward: {entry['backward']['median_us']:9.1f} us   "
            f"vs eager {ratio_text(entry, 'eager'):<15}  vs compile {ratio_text(entry, 'compile')}")


# ----------------------------------------------------------------------------------------------
# Profiles: where the time goes


def _self_us(evt, device: str) -> float:
    """Self time of a key_averages() row: CPU self time, or device time for a kernel row."""
    if device == "cpu":
        return evt.self_cpu_time_total
    for attr in ("self_device_time_total", "self_cuda_time_total", "device_time_total",
                 "cuda_time_total"):
        value = getattr(evt, attr, 0) or 0
        if value:
            return value
    return 0.0


def _is_device_row(evt) -> bool:
    return getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA


def profile_rows(run: Callable[[], object], device: str, iters: int) -> list[dict]:
    """key_averages() of `iters` calls of run(): per call, self CPU time of each op and, on a
    GPU, device time of each kernel (rows of kind "kernel")."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    run()  # warm: allocator, lazy init
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
        us = (_self_us(evt, "cuda") if kernel else evt.self_cpu_time_total) / iters
        if us > 0:
            rows.append({"name": evt.key, "kind": "kernel" if kernel else "op",
                         "calls": evt.count / iters, "us_per_call": us})
    return sorted(rows, key=lambda r: -r["us_per_call"])


def phase_runner(fn, inputs, grad_outputs, phase: str) -> Callable[[], object]:
    if phase == "forward":
        return lambda: fn(*inputs)
    outputs = fn(*inputs)
    return lambda: torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=True)


def breakdown(rows: list[dict], device: str) -> dict:
    """GEMM time and the rest, per call, from profile rows (kernels on a GPU, ops on the CPU)."""
    if device == "cuda":
        kernels = [r for r in rows if r["kind"] == "kernel"]
        gemm = sum(r["us_per_call"] for r in kernels if GEMM_KERNEL.search(r["name"]))
        total = sum(r["us_per_call"] for r in kernels)
    else:
        ops = [r for r in rows if r["kind"] == "op"]
        gemm = sum(r["us_per_call"] for r in ops if r["name"] in GEMM_OPS)
        total = sum(r["us_per_call"] for r in ops)
    return {"gemm_us": gemm, "profiled_total_us": total}


def short_name(name: str, width: int = 70) -> str:
    name = re.sub(r"\(.*\)$", "", name.replace("(anonymous namespace)::", ""))
    return name if len(name) <= width else name[: width - 3] + "..."


# ----------------------------------------------------------------------------------------------
# GPU: bandwidth of the fused pointwise kernels against a copy


def bandwidth(plan: Plan, impls: list[Impl], log=print) -> dict:
    """Achieved bandwidth of the stages' fused kernels at the large configuration, and of a
    device-to-device copy of the same traffic, both from torch.profiler kernel times.

    Kernel time from the profiler isolates the pointwise kernels from the GEMMs, the cat and the
    launch overhead around them, and is measured the same way for the copy, so the ratio compares
    like with like. Bytes moved = elements (batch x state) x values per element x element size
    (6 values forward, 10 backward; see FORWARD_VALUES_PER_ELEMENT).
    """
    config, device = plan.large, "cuda"
    elements = config.batch * config.state
    itemsize = torch.tensor([], dtype=DTYPE).element_size()
    out = {"config": config.name, "elements": elements, "element_size_B": itemsize,
           "bytes_per_element": {"forward": FORWARD_VALUES_PER_ELEMENT * itemsize,
                                 "backward": BACKWARD_VALUES_PER_ELEMENT * itemsize},
           "kernels": {}}

    # The copy: a buffer of half the forward traffic, read once and written once.
    copy_values = elements * FORWARD_VALUES_PER_ELEMENT // 2
    src = torch.rand(copy_values, device=device, dtype=DTYPE)
    dst = torch.empty_like(src)
    rows = profile_rows(lambda: dst.copy_(src), device, plan.profile_iters)
    copy_us = sum(r["us_per_call"] for r in rows if r["kind"] == "kernel")
    copy_bytes = 2 * copy_values * itemsize
    out["copy"] = {"bytes": copy_bytes, "kernel_us": copy_us,
                   "GBps": copy_bytes / copy_us / 1e3 if copy_us else None,
                   "kernels": [r["name"] for r in rows if r["kind"] == "kernel"]}
    del src, dst
    log(f"\n[bench] cuda bandwidth at {config.describe()}: device-to-device copy of "
        f"{copy_bytes / 1e6:.0f} MB: {copy_us:.1f} us, {out['copy']['GBps'] or 0:.0f} GB/s")

    inputs = make_inputs(config, device)
    grad_outputs = make_grad_outputs(config, device)
    for impl in impls:
        if not impl.key.startswith("stage"):
            continue
        impl.prepare(config)
        entry = out["kernels"][impl.key] = {"label": impl.label}
        for phase in ("forward", "backward"):
            rows = profile_rows(phase_runner(impl.fn, inputs, grad_outputs, phase), device,
                                plan.profile_iters)
            fused = [r for r in rows if r["kind"] == "kernel" and "lltm" in r["name"].lower()]
            us = sum(r["us_per_call"] for r in fused)
            moved = out["bytes_per_element"][phase] * elements
            gbps = moved / us / 1e3 if us else None
            entry[phase] = {
                "kernels": [short_name(r["name"]) for r in fused], "kernel_us": us,
                "bytes": moved, "GBps": gbps,
                "fraction_of_copy": gbps / out["copy"]["GBps"] if gbps and out["copy"]["GBps"]
                else None,
                "all_kernels": [{"name": short_name(r["name"]), "us_per_call": r["us_per_call"]}
                                for r in rows if r["kind"] == "kernel"][:8],
            }
            if us:
                log(f"  {impl.label:<34} {phase:<8} fused kernel {us:8.1f} us, {gbps:6.0f} GB/s "
                    f"= {entry[phase]['fraction_of_copy']:.0%} of copy")
            else:
                log(f"  {impl.label:<34} {phase:<8} no kernel named *lltm* in the profile")
    return out


# ----------------------------------------------------------------------------------------------
# Targets


@dataclasses.dataclass
class Target:
    name: str
    config: str
    impl: str  # the implementation measured
    base: str  # "eager", "compile" or "copy"
    phase: str  # "forward", "backward", "step" (forward + backward)
    threshold: float


TARGETS = {
    "cpu": [
        Target("stage 05 forward >= 2.0x eager", "tutorial", "stage05", "eager", "forward", 2.0),
        Target("stage 05 backward >= 1.5x eager", "tutorial", "stage05", "eager", "backward", 1.5),
        Target("stage 05 forward + backward not slower than torch.compile", "tutorial",
               "stage05", "compile", "step", 1.0),
        Target("stage 05 forward + backward not slower than torch.compile", "large",
               "stage05", "compile", "step", 1.0),
    ],
    "cuda": [
        Target("stage 05 forward >= 2x eager", "tutorial", "stage05", "eager", "forward", 2.0),
        Target("stage 05 backward >= 1.5x eager", "tutorial", "stage05", "eager", "backward", 1.5),
        Target("stage 05 forward + backward >= 1.0x torch.compile", "tutorial",
               "stage05", "compile", "step", 1.0),
        Target("stage 05 forward + backward >= 1.0x torch.compile", "large",
               "stage05", "compile", "step", 1.0),
        Target("stage 05 forward kernel >= 80% of copy bandwidth", "large",
               "stage05", "copy", "forward", 0.8),
        Target("stage 05 backward kernel >= 80% of copy bandwidth", "large",
               "stage05", "copy", "backward", 0.8),
    ],
}


def evaluate_targets(device: str, section: dict) -> list[dict]:
    """Each target with its measured value and met / missed / not evaluated (and why not)."""
    out = []
    by_key = {(r["config"], r["impl"]): r for r in section["results"]}
    for t in TARGETS[device]:
        row = dataclasses.asdict(t)
        if t.base == "copy":
            kernel = section.get("bandwidth", {}).get("kernels", {}).get(t.impl, {})
            value = (kernel.get(t.phase) or {}).get("fraction_of_copy")
            missing = "no bandwidth measurement of the stage's kernel"
        else:
            entry = by_key.get((t.config, t.impl))
            value = (entry or {}).get(f"vs_{t.base}", {}).get(t.phase)
            base = by_key.get((t.config, t.base))
            if entry and base:
                phases = ("forward", "backward") if t.phase == "step" else (t.phase,)
                row["noise"] = max(e[p]["iqr_us"] / e[p]["median_us"]
                                   for e in (entry, base) for p in phases)
            missing = (f"{t.impl} not measured at {t.config}" if entry is None
                       else f"no validated {t.base} measurement at {t.config}")
        row["value"] = value
        if value is None:
            row["status"], row["why"] = "not evaluated", missing
        else:
            row["status"] = "met" if value >= t.threshold else "missed"
        out.append(row)
    return out


def explain_missed(device: str, plan: Plan, impls: list[Impl], section: dict, log=print) -> None:
    """For each missed speed target, profile both sides and say where the time goes.

    The argument is Amdahl's: the GEMMs are the same calls in every implementation, so a stage
    can at best remove the rest. `bound` is the baseline's time over the stage's GEMM time alone,
    the ratio the stage would reach if everything but its GEMMs cost nothing.
    """
    by_impl = {i.key: i for i in impls}
    configs = {c.name: c for c in plan.configs()}
    for target in section["targets"]:
        if target["status"] != "missed" or target["base"] == "copy":
            continue
        config = configs[target["config"]]
        phases = ("forward", "backward") if target["phase"] == "step" else (target["phase"],)
        inputs = make_inputs(config, device)
        grad_outputs = make_grad_outputs(config, device)
        sides = {}
        for key in (target["impl"], target["base"]):
            impl = by_impl[key]
            impl.prepare(config)
            impl.fn(*inputs)  # compile (cached) before profiling
            sides[key] = {}
            for phase in phases:
                rows = profile_rows(phase_runner(impl.fn, inputs, grad_outputs, phase), device,
                                    plan.profile_iters)
                entry = next(r for r in section["results"]
                             if r["impl"] == key and r["config"] == config.name)
                sides[key][phase] = dict(breakdown(rows, device),
                                         median_us=entry[phase]["median_us"],
                                         top=[dict(r, name=short_name(r["name"]))
                                              for r in rows[:8]])
        target["profile"] = sides
        target["why"] = reason_text(target, sides, section["gemm_floor"][config.name], device)
        log(f"\n[bench] missed: {target['name']} ({target['config']}): {target['why']}")


def reason_text(target: dict, sides: dict, floor: dict, device: str) -> str:
    impl, base = target["impl"], target["base"]
    phases = list(sides[impl])
    t_impl = sum(sides[impl][p]["median_us"] for p in phases)
    t_base = sum(sides[base][p]["median_us"] for p in phases)
    gemm = sum(floor[p]["median_us"] for p in phases)
    what = "+".join(phases)
    parts = [
        f"{what}: {impl} {t_impl:.1f} us, {base} {t_base:.1f} us (medians). The GEMMs alone "
        f"take {gemm:.1f} us ({gemm / t_impl:.0%} of {impl}, {gemm / t_base:.0%} of {base}); "
        f"the rest costs {t_impl - gemm:.1f} us in {impl} against {t_base - gemm:.1f} us in "
        f"{base}."
    ]
    bound = t_base / gemm
    if bound < target["threshold"]:
        parts.append(f"Even with everything but the GEMMs at zero cost, {impl} would reach only "
                     f"{bound:.2f}x: at this size the target is beyond what fusing the pointwise "
                     f"part can buy; the time is the GEMMs'.")
    else:
        parts.append(f"With everything but the GEMMs at zero cost it would reach {bound:.2f}x, so "
                     f"the non-GEMM part falls short; the profiles below show where it goes.")
    if device == "cuda":
        kernel = sum(sides[impl][p]["profiled_total_us"] for p in phases)
        if kernel < 0.5 * t_impl:
            parts.append(f"The GPU is busy only {kernel:.1f} us of {t_impl:.1f} us per call: "
                         f"launch-bound, the time is CPU-side dispatch.")
    return " ".join(parts)


def gemm_floor(config: Config, device: str, min_run_time: float, rounds: int = 1) -> dict:
    """The cell's GEMMs alone, timed like the implementations: the floor no stage gets under.

    forward: G = X W^T + b (addmm; X = [h, x]); backward: dX = dG W and dW = dG^T X (two mm).
    Every implementation here runs these same ATen/BLAS calls (torch.compile's included, which
    calls them as extern kernels), so implementation time minus this is its non-GEMM time.
    """
    b, f, s = config.shape
    gen = torch.Generator(device=device).manual_seed(2)

    def rand(*shape):
        return torch.rand(shape, generator=gen, device=device, dtype=DTYPE)

    x, w, bias, dg = rand(b, f + s), rand(3 * s, f + s), rand(3 * s), rand(b, 3 * s)
    runs = {"forward": lambda: torch.addmm(bias, x, w.t()),
            "backward": lambda: (dg.mm(w), dg.t().mm(x))}
    return {phase: min((timing.measure(fn, min_run_time=min_run_time) for _ in range(rounds)),
                       key=lambda t: t.median_us).as_dict() for phase, fn in runs.items()}


# ----------------------------------------------------------------------------------------------
# Report: JSON, Markdown, PNG


def machine_info(device: str) -> dict:
    info = {
        "device": device, "slug": timing.machine_slug(device),
        "description": timing.describe_machine(device),
        "torch": torch.__version__, "python": platform.python_version(),
        "threads": torch.get_num_threads(), "cores": os.cpu_count(),
        "cpu": _cpu_model(), "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_GiB=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, capability=f"{props.major}.{props.minor}")
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_report(out_dir: Path, report: dict) -> dict[str, Path]:
    """<slug>.json, .md and .png in out_dir. A hand-written <slug>.notes.md there (the reading of
    a committed run) is appended to the .md; `--render` rebuilds .md and .png from the .json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = report["machine"]["slug"]
    paths = {ext: out_dir / f"{slug}.{ext}" for ext in ("json", "md", "png")}
    paths["json"].write_text(json.dumps(report, indent=1) + "\n")
    plot(report, paths["png"])
    notes = out_dir / f"{slug}.notes.md"
    paths["md"].write_text(markdown(report, paths["png"].name)
                           + (f"\n{notes.read_text()}" if notes.is_file() else ""))
    return paths


def _fmt_ratio(entry: dict | None, base: str) -> str:
    r = (entry or {}).get(f"vs_{base}")
    return f"{r['forward']:.2f}x / {r['backward']:.2f}x" if r else "-"


def markdown(report: dict, png_name: str) -> str:
    m, plan = report["machine"], report["plan"]
    lines = [f"# LLTM benchmark: {m['description']}", ""]
    if report["smoke"]:
        lines += ["**Smoke run: tiny sizes and few iterations; the numbers mean nothing.**", ""]
    lines += [
        f"- machine: `{m['slug']}`; {m['cpu']}, {m['cores']} cores; torch {m['torch']}; "
        f"**{m['threads']} intra-op threads**" + (f"; {m['gpu']} (CUDA {m['cuda']})"
                                                  if m["device"] == "cuda" else ""),
        f"- run: {report['date']}, commit {report['commit']}, load average "
        f"{report['load_before']} before, {report['load_after']} after, {report['wall_s']:.0f} s",
        f"- float32; forward timed with autograd recording, backward alone (graph replayed with "
        f"retain_graph=True); medians of torch.utils.benchmark blocks over at least "
        f"{plan['min_run_time']} s, in {plan['rounds']} round(s) interleaved over the "
        f"implementations, the lowest round's median kept; ratios are baseline time / "
        f"implementation time (above 1: faster than the baseline)",
        f"- every implementation was checked against the float64 reference first (outputs and "
        f"all five input gradients, relative error <= {TOLERANCE[DTYPE]:.0e}); refused ones are "
        f"listed, not timed",
        f"- torch.compile: {report['compile_settings']}; first call (compile or cache load) per "
        f"configuration: " + ", ".join(f"{k} {v} s" for k, v in report["compile_first_call_s"].items()),
        "",
    ]
    by_config: dict[str, list[dict]] = {}
    for r in report["results"]:
        by_config.setdefault(r["config"], []).append(r)
    for name in ("tutorial", "large"):
        rows = by_config.get(name, [])
        if not rows:
            continue
        r0 = rows[0]
        lines += [f"## {name}: batch {r0['batch']}, features {r0['features']}, state {r0['state']}",
                  "", "| implementation | Forward | Backward | vs eager (fwd / bwd) | "
                  "vs compile (fwd / bwd) | max rel. error |", "|---|--:|--:|--:|--:|--:|"]
        for r in rows:
            lines.append(f"| {r['label']} | {r['forward']['median_us']:.1f} us | "
                         f"{r['backward']['median_us']:.1f} us | {_fmt_ratio(r, 'eager')} | "
                         f"{_fmt_ratio(r, 'compile')} | {r['max_relative_error']:.1e} |")
        floor = report["gemm_floor"].get(name)
        if floor:
            lines.append(f"| *GEMMs alone (the floor; not an implementation)* | "
                         f"*{floor['forward']['median_us']:.1f} us* | "
                         f"*{floor['backward']['median_us']:.1f} us* | | | |")
        lines += ["", "```"] + [tutorial_line(r) for r in rows] + ["```", ""]
    sweep = [r for r in report["results"] if r["config"].startswith("sweep-")]
    if sweep:
        impls = list(dict.fromkeys(r["label"] for r in sweep))
        states = sorted({r["state"] for r in sweep})
        cell = {(r["label"], r["state"]): r for r in sweep}
        lines += [f"## Sweep over state size: batch {plan['sweep_batch']}, features "
                  f"{plan['sweep_features']}", "", f"![sweep]({png_name})", "",
                  "Forward / backward median, us:", "",
                  "| state | " + " | ".join(impls) + " |", "|--:|" + "--:|" * len(impls)]
        for s in states:
            vals = [cell.get((i, s)) for i in impls]
            lines.append(f"| {s} | " + " | ".join(
                f"{v['forward']['median_us']:.1f} / {v['backward']['median_us']:.1f}" if v else "-"
                for v in vals) + " |")
        lines.append("")
    if report.get("bandwidth"):
        bw = report["bandwidth"]
        copy = bw["copy"]
        lines += [f"## Bandwidth of the fused pointwise kernels ({bw['config']} configuration)", "",
                  f"Bytes per (batch, state) element, float32: forward 6 values = "
                  f"{bw['bytes_per_element']['forward']} B (reads gates x3, old_cell; writes "
                  f"new_h, new_cell), backward 10 values = {bw['bytes_per_element']['backward']} B "
                  f"(reads grad_h, grad_cell, new_cell, gates x3; writes d_gates x3, d_old_cell); "
                  f"{bw['elements']:,} elements. Kernel times from torch.profiler, as for the copy.",
                  "", f"Device-to-device copy of {copy['bytes'] / 1e6:.1f} MB (read + write): "
                  f"{copy['kernel_us']:.1f} us, **{copy['GBps'] or 0:.0f} GB/s**.", "",
                  "| implementation | phase | fused kernel | time | GB/s | of copy |",
                  "|---|---|---|--:|--:|--:|"]
        for entry in bw["kernels"].values():
            for phase in ("forward", "backward"):
                k = entry.get(phase, {})
                frac = k.get("fraction_of_copy")
                lines.append(f"| {entry['label']} | {phase} | {', '.join(k.get('kernels', [])) or '-'}"
                             f" | {k.get('kernel_us', 0):.1f} us | {k.get('GBps') or 0:.0f} | "
                             f"{f'{frac:.0%}' if frac else '-'} |")
        lines.append("")
    lines += ["## Targets", "", "Measured: the ratio (baseline time / stage 05 time) or the "
              "fraction of copy bandwidth; noise: the largest IQR / median among the timings "
              "compared.", "", "| target | config | measured | threshold | noise | status |",
              "|---|---|--:|--:|--:|---|"]
    for t in report["targets"]:
        unit = "" if t["base"] == "copy" else "x"
        value = "-" if t["value"] is None else (
            f"{t['value']:.0%}" if t["base"] == "copy" else f"{t['value']:.2f}x")
        threshold = f"{t['threshold']:.0%}" if t["base"] == "copy" else f"{t['threshold']:.2f}{unit}"
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
                lines += [f"{key}, {phase}: median {prof['median_us']:.1f} us; profile top "
                          f"(self time per call, profiler overhead included):", "",
                          "| op / kernel | kind | calls | us per call |", "|---|---|--:|--:|"]
                lines += [f"| `{r['name']}` | {r['kind']} | {r['calls']:g} | {r['us_per_call']:.1f} |"
                          for r in prof["top"]]
                lines.append("")
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = [r for r in report["results"] if r["config"].startswith("sweep-")]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    labels = list(dict.fromkeys(r["label"] for r in sweep))
    for label in labels:
        rows = sorted((r for r in sweep if r["label"] == label), key=lambda r: r["state"])
        states = [r["state"] for r in rows]
        for col, phase in enumerate(("forward", "backward")):
            axes[0, col].plot(states, [r[phase]["median_us"] for r in rows], marker="o",
                              label=label)
            axes[1, col].plot(states, [r.get("vs_eager", {}).get(phase, math.nan) for r in rows],
                              marker="o", label=label)
    floors = sorted((int(name.split("-s")[1]), f) for name, f in report["gemm_floor"].items()
                    if name.startswith("sweep-s"))
    if floors:
        for col, phase in enumerate(("forward", "backward")):
            axes[0, col].plot([s for s, _ in floors], [f[phase]["median_us"] for _, f in floors],
                              color="black", ls="--", lw=1, label="GEMMs alone (floor)")
    plan, m = report["plan"], report["machine"]
    for col, phase in enumerate(("forward", "backward")):
        axes[0, col].set_title(f"{phase}: median time")
        axes[0, col].set_ylabel("us per call")
        axes[0, col].set_yscale("log")
        axes[1, col].set_title(f"{phase}: speedup over eager PyTorch")
        axes[1, col].set_ylabel("eager time / time")
        axes[1, col].axhline(1.0, color="gray", lw=0.8)
        axes[1, col].set_xlabel("state size")
        for row in range(2):
            axes[row, col].set_xscale("log", base=2)
            axes[row, col].grid(True, which="both", alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"LLTM, batch {plan['sweep_batch']}, features {plan['sweep_features']}, "
                 f"float32 - {m['description']}" + (" (SMOKE)" if report["smoke"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, few iterations")
    parser.add_argument("--out", type=Path, help="output folder (default bench/results, or "
                        "build/bench-smoke with --smoke)")
    parser.add_argument("--device", choices=("all", "cpu", "cuda"), default="all")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--min-run-time", type=float, help="seconds per measurement")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="measure nothing: rewrite the .md and .png of a report's .json")
    args = parser.parse_args(argv)
    if args.render:
        paths = write_report(args.render.parent, json.loads(args.render.read_text()))
        print(f"[bench] wrote {paths['md']}, {paths['png']}")
        return 0

    if args.threads:
        torch.set_num_threads(args.threads)
    out_dir = args.out or (build.build_root() / "bench-smoke" if args.smoke
                           else REPO / "bench" / "results")
    devices = ["cpu"] if args.device in ("all", "cpu") else []
    if args.device in ("all", "cuda"):
        if torch.cuda.is_available():
            devices.append("cuda")
        else:
            print("[bench] GPU section skipped: torch.cuda.is_available() is False "
                  f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})")
    print(f"[bench] torch {torch.__version__}; CPU: {torch.get_num_threads()} intra-op threads on "
          f"{os.cpu_count()} cores; inductor cache {os.environ['TORCHINDUCTOR_CACHE_DIR']}")
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if busy > 0.5 * (os.cpu_count() or 1):
        print(f"[bench] WARNING: load average {busy:.1f} on {os.cpu_count()} cores: other work is "
              f"running, timings will be noisy (see bench/README.md)")
    print("[bench] building and importing the stages ...", flush=True)
    modules, skipped = discover(devices)
    for key, reason in skipped.items():
        print(f"[bench] {key} not run: {reason}")

    status = 0
    for device in devices:
        start, load_before = time.perf_counter(), _load()
        plan = PLANS[(device, args.smoke)]
        if args.min_run_time:
            plan = dataclasses.replace(plan, min_run_time=args.min_run_time)
        impls = implementations(device, modules)
        print(f"\n[bench] ===== {timing.describe_machine(device)}; implementations: "
              f"{', '.join(i.key for i in impls)}")
        section = run_device(device, plan, impls)
        if device == "cuda":
            section["bandwidth"] = bandwidth(plan, impls)
        section["targets"] = evaluate_targets(device, section)
        explain_missed(device, plan, impls, section)
        report = {
            "machine": machine_info(device), "smoke": args.smoke, "commit": _git_commit(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "plan": dataclasses.asdict(plan), "dtype": str(DTYPE),
            "compile_settings": CompiledReference.settings,
            "implementations": {i.key: i.label for i in impls},
            "skipped": {k: v for k, v in skipped.items()
                        if k not in {i.key for i in impls}},
            **section,
            "load_before": load_before, "load_after": _load(),
            "wall_s": time.perf_counter() - start,
        }
        paths = write_report(out_dir, report)
        print("\n[bench] targets:")
        for t in report["targets"]:
            value = "-" if t["value"] is None else f"{t['value']:.2f}"
            print(f"  {t['status']:<13} {t['name']} ({t['config']}): {value} "
                  f"(threshold {t['threshold']})")
        print(f"[bench] wrote {', '.join(str(p) for p in paths.values())}")
        if report["refused"]:
            status = 1
    return status


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
