"""make demo: build what this machine runs, check each op against its reference, time it.

The stages to run come first (`plan`): one per package, the newest; without a GPU, no CUDA-only
stage, and the others built CPU-only, so that nvcc never runs for kernels that could not run
here. They are built side by side (workbook.build.side_by_side). Then, for every op that a
stage implements (the stages' stage.toml files say which), at the op's demo sizes (its
descriptor's demo_case, float32): each stage's op is checked against the float64 reference,
outputs and input gradients, and timed beside the op's baselines (plain PyTorch; for the
deformable convolution torchvision too), in interleaved rounds: one line per implementation,
`Forward: X us +-n% | Backward: Y us +-n%`, the median over the rounds with its IQR / median,
and its speedup over the first line with that ratio's noise. A busy machine (other processes on
the cores the demo times on) or a noisy ratio is said so, and the ratios marked UNRELIABLE.
"""

from __future__ import annotations

import sys

import torch

from workbook import ops
from workbook.build import builder, loader, side_by_side, stages
from workbook.build.loader import import_stage
from workbook.measure import timing
from workbook.spec import OpSpec, Sample, compare


def plan(gpu: bool) -> tuple[list[stages.Stage], dict[int, str]]:
    """The stages the demo builds and runs here, and why each other stage is not run.

    One stage per package (a package loads once per process): the one a user would import, the
    production stage where the package has one (`make install`'s), else the newest. Without a
    GPU nothing is compiled that cannot run: a CUDA-only stage is not built, and a stage with a
    CPU fallback is built CPU-only, in a folder of its own (build/stages-cpu/, where `make test`
    builds it too without a GPU), unless its full build is already up to date. `make test` runs
    the CUDA tests on the emulated CUDA device, and `make nvcc-check` compiles every CUDA file.
    """
    from workbook.build import toolkit

    chosen: dict[str, stages.Stage] = {}
    not_run: dict[int, str] = {}
    newest_first = list(reversed(stages.all_stages()))
    for s in sorted(newest_first, key=lambda s: not s.production):  # production stages first
        if s.package in chosen:
            not_run[s.number] = (f"its package `{s.package}` is {chosen[s.package].label}'s "
                                 f"too, and one loads per process: `make stage {s.number}` "
                                 f"tests it")
        elif s.cuda and not gpu and not s.own_cpu_kernels:
            others = " and ".join(f"stage {int(f[:2])}" for f in s.sources_from)
            not_run[s.number] = (f"without a GPU it is {others}'s CPU kernels again, and its "
                                 f"own are CUDA: `make stage {s.number}` runs them on the "
                                 f"emulated CUDA device")
        elif s.cuda and not gpu and not s.cpu_fallback:
            not_run[s.number] = (f"CUDA only, and there is no GPU here, so it is not built; "
                                 f"`make stage {s.number}` builds it and runs its tests on the "
                                 f"emulated CUDA device")
        elif s.cuda and not gpu and toolkit.find() is not None and not builder.is_up_to_date(s):
            chosen[s.package] = s.cpu_only_build()
        else:
            chosen[s.package] = s
    return sorted(chosen.values(), key=lambda s: s.number), not_run


def load(stage: stages.Stage) -> tuple[object | None, str]:
    """The stage's package (built already), or None and why not."""
    try:
        return import_stage(stage, quiet=False), ""
    except (builder.StageSkipped, loader.StageConflict, RuntimeError, ImportError) as error:
        return None, str(error)


def against_reference(label: str, fn, spec: OpSpec, sample: Sample) -> bool:
    """One line: how far `fn` is from the float64 reference on `sample`; whether within the
    op's tolerances."""
    result = compare(fn, spec, sample)
    print(f"  {label:<44} max relative error vs float64: outputs "
          f"{result.worst('output'):.1e}, gradients {result.worst('gradient'):.1e}  "
          f"{'OK' if result.ok else 'MISMATCH'}")
    for failure in result.failures():
        print(f"      {failure}")
    return result.ok


# Each op is timed in ROUNDS interleaved rounds of one MIN_RUN_TIME block per line and phase: some
# ROUNDS x lines x 2 x MIN_RUN_TIME seconds (3.5 s for the LLTM's five lines), more where a call
# takes longer than a block (torchvision's deformable backward) or the machine is busy. Seven
# rounds: the IQR of seven values rests on more than two of them.
ROUNDS, MIN_RUN_TIME = 7, 0.05


def pick_threads() -> int:
    """The intra-op threads to time with: torch's count, less the cores other processes keep busy
    in a 0.3 s look (timing.choose_threads); printed, with why. Two OpenMP threads on a core that a
    compiler also wants wait on each other at every parallel region: fewer threads than cores is
    slower on a quiet machine, and far less wrong on a busy one."""
    load = timing.probe()
    threads = timing.choose_threads(load, most=torch.get_num_threads())
    print(f"\n[demo] timing with {threads} intra-op thread{'s' * (threads != 1)} (torch's count: "
          f"{torch.get_num_threads()}): in a {load.seconds:.1f} s look, {load.describe()}")
    return threads


def time_lines(lines: list[tuple[str, object]], sample: Sample
               ) -> tuple[dict[str, tuple[timing.Repeated, timing.Repeated]], timing.Verdict]:
    """Every line's (forward, backward) times, in rounds interleaved over the lines and phases
    (timing.interleaved), and the verdict on them: other processes' load meanwhile, each
    timing's noise (IQR / median over the rounds)."""
    runs = {}
    for label, fn in lines:
        call, tensors = sample.bind(fn)
        runs[label, "forward"], runs[label, "backward"] = timing.autograd_runners(call, tensors)
    with timing.LoadMonitor() as watch:
        found = timing.interleaved(runs, rounds=ROUNDS, min_run_time=MIN_RUN_TIME)
    verdict = timing.Verdict.judge(watch.load, {f"{label} {phase}": t.noise
                                                for (label, phase), t in found.items()})
    times = {label: (found[label, "forward"], found[label, "backward"]) for label, _ in lines}
    return times, verdict


def line_text(label: str, times: tuple[timing.Repeated, timing.Repeated],
              base: tuple[timing.Repeated, timing.Repeated] | None, verdict: timing.Verdict) -> str:
    """`Forward: X us +-n% | Backward: Y us +-n%`, then, against the first line, `(fx +-n% | bx
    +-n%)`: its speedups and their noise; `UNRELIABLE` after them when the machine was busy or
    a ratio's noise passed timing.NOISY."""
    fwd, bwd = times
    text = (f"  {label:<44} Forward: {fwd.median_us:9.1f} us +-{fwd.noise:<4.0%}| "
            f"Backward: {bwd.median_us:9.1f} us +-{bwd.noise:<4.0%}")
    if base is None:
        return text
    ratios = [timing.ratio(b, t) for b, t in zip(base, times)]
    shown = " | ".join(f"{r:.2f}x +-{noise:.0%}" for r, noise in ratios)
    mark = ": UNRELIABLE" if any(verdict.unreliable(noise) for _, noise in ratios) else ""
    return f"{text} ({shown}{mark})"


def demo_op(name: str, modules: dict[int, object], devices: list[str],
            threads: int | None = None) -> bool:
    """Check every stage's `name` against the float64 reference, then time them beside the op's
    baselines with `threads` intra-op threads (None: pick_threads() chooses them, here)."""
    spec = ops.get(name)
    providers = [s for s in stages.providing(name) if s.number in modules]
    ok = True
    sizes = ", ".join(f"{k} {v}" for k, v in spec.demo_case.sizes.items())
    for device in devices:
        runnable = [s for s in providers if device in s.devices]
        if not runnable:
            continue
        with timing.intra_op_threads(pick_threads() if threads is None else threads):
            ok &= demo_device(name, spec, sizes, device, modules, runnable)
    return ok


def demo_device(name: str, spec: OpSpec, sizes: str, device: str, modules: dict[int, object],
                runnable: list[stages.Stage]) -> bool:
    sample = spec.make(spec.demo_case, device=device, dtype=torch.float32)
    impls = [(f"{s.number:02d} {s.package}.{name}", getattr(modules[s.number], name))
             for s in runnable]
    print(f"\n[demo] {name}, {sizes}, float32, on {timing.describe_machine(device)}")
    print("  checked against the float64 reference first:")
    ok = True
    for label, fn in impls:
        ok &= against_reference(f"{label} ({device})", fn, spec, sample)
    lines = [(f"{label} ({device})", fn) for label, fn in [*spec.baseline_functions().items(),
                                                             *impls]]
    print(f"  then timed in {ROUNDS} rounds interleaved over the lines (forward with autograd "
          f"recording; backward alone): medians over the rounds, +- their IQR / median; in "
          f"brackets the speedup over the first line:")
    times, verdict = time_lines(lines, sample)
    print(f"  [demo] {verdict.summary()}")
    base = times[lines[0][0]]
    for label, _ in lines:
        print(line_text(label, times[label], None if label == lines[0][0] else base, verdict))
    return ok


def main() -> int:
    gpu = torch.cuda.is_available()
    to_run, not_run = plan(gpu)
    cpu_only = [s for s in to_run if s.cpu_only]
    if cpu_only:
        print(f"[demo] no GPU here: stage {', '.join(str(s.number) for s in cpu_only)} built "
              f"CPU-only (their CUDA kernels could not run); nvcc is not used")
    print(f"[demo] building stages {', '.join(str(s.number) for s in to_run)} (the first time "
          f"takes minutes; compiler output in build/stages*/<stage>/build.log) ...", flush=True)
    side_by_side.build_side_by_side(to_run)
    modules = {}
    for s in to_run:
        module, why = load(s)
        if module is None:
            not_run[s.number] = why
        else:
            modules[s.number] = module
    devices = ["cpu"] + (["cuda"] if gpu else [])
    threads = pick_threads()
    ok = True
    for name in dict.fromkeys(op for s in stages.all_stages() for op in s.ops):
        ok &= demo_op(name, modules, devices, threads)
    for number, reason in sorted(not_run.items()):
        print(f"\n[demo] {stages.get(number).label} not run here: {reason}")
    if not gpu:
        print("\n[demo] no GPU here: the CUDA kernels were not built. `make test` compiles every "
              "CUDA file and runs the CUDA tests on the emulated CUDA device (correctness only).")
    print("\n[demo] every implementation matches its reference." if ok else
          "\n[demo] MISMATCH: see above.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
