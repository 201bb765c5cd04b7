"""Building several stages at the same time, and the command line: ``python -m workbook.build N``
(stage N, or `all`), what `make test` and `make demo` run first.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

from workbook.build import emulate, stages, toolkit
from workbook.build.builder import StageSkipped, build_stage, is_up_to_date, toolkit_for
from workbook.build.compiler import compiler_cache, cuda_toolkit, max_jobs
from workbook.build.loader import import_stage
from workbook.build.stages import Stage, build_root


def _build_one(s: Stage, *, force: bool = False, require_cuda: bool = False) -> int:
    """Build (or, for a JIT stage, import) one stage, printing what happens; the exit status."""
    if s.kind == "jit":
        print(f"[build] stage {s.number} ({s.folder}) compiles just in time when imported; "
              f"importing it (cached under {build_root() / 'jit'}) ...", flush=True)
        start = time.perf_counter()
        try:
            import_stage(s)
        except Exception as error:  # a compile error surfaces as an ImportError or RuntimeError
            print(f"[build] {s.label} failed to build: {error}")
            return 1
        print(f"[build] stage {s.number} ({s.folder}) ready in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        return 0
    try:
        build_stage(s, force=force)
    except StageSkipped as skipped:
        print(f"[build] {skipped}", flush=True)
        return 1 if require_cuda else 0
    except RuntimeError as error:
        print(f"[build] {error}", flush=True)
        return 1
    return 0


def _weight(s: Stage) -> int:
    """A rough cost of building s, to start the longest builds first: its translation units,
    a .cu file (nvcc, for one or more GPU architectures) counting as three."""
    if s.kind == "jit":
        return 1
    units = [p for folder in s.source_dirs for pat in ("*.cpp", "*.cu") for p in folder.rglob(pat)]
    with_cuda = toolkit_for(s) is not None
    return sum(3 if p.suffix == ".cu" else 1 for p in units if with_cuda or p.suffix != ".cu")


@dataclasses.dataclass
class _Task:
    """One build of build_side_by_side: a command, run in a process of its own."""

    label: str
    command: list[str]
    weight: int
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    # What it compiles, for the order (_after): the flags that set its objects apart (package,
    # ABI, flavour) and its translation units.
    flags: tuple = ()
    units: frozenset[Path] = frozenset()


def _units(s: Stage, suffixes: tuple[str, ...]) -> frozenset[Path]:
    return frozenset(p.resolve() for folder in s.source_dirs for suffix in suffixes
                     for p in folder.rglob(f"*{suffix}"))


def _tasks(targets: list[Stage], *, force: bool, require_cuda: bool,
           emulated: bool) -> list[_Task]:
    tasks = []
    for s in targets:
        if not force and s.kind != "jit" and is_up_to_date(s):
            print(f"[build] {s.label} is up to date in {s.lib_dir}")
            continue
        command = [sys.executable, "-m", "workbook.build", str(s.source_dir)]
        command += ["--force"] * force + ["--require-cuda"] * require_cuda
        tasks.append(_Task(s.label, command, _weight(s),
                           {"WORKBOOK_NO_CUDA": "1"} if s.cpu_only else {},
                           (s.kind, s.package, s.stable_abi, s.cpu_only),
                           _units(s, (".cpp", ".cu"))))
    for s in targets if emulated else []:
        if s.cuda:  # its .cu files for the emulated device (host code), as its tests will load
            units = _units(s, (".cu",))
            tasks.append(_Task(f"{s.label}, emulated", [sys.executable, "-m",
                                                         "workbook.build.emulate",
                                                         "build", str(s.source_dir)],
                               2 * len(units), {}, ("emulated", s.package, s.stable_abi), units))
    return tasks


def _after(task: _Task, tasks: list[_Task]) -> list[_Task]:
    """The builds `task` waits for: those that compile all of its translation units and more,
    with the same flags. Stage 09 compiles stage 07's files and its own, as 07 compiles 06's:
    built side by side, 07 and 09 would compile 07's files twice at once; with 09 first, 07
    finds all of them in the compiler cache (where there is one) and only links."""
    return [other for other in tasks if other is not task and other.flags == task.flags
            and task.units and task.units < other.units]


def build_side_by_side(targets: list[Stage], *, force: bool = False,
                       require_cuda: bool = False, emulated: bool = False) -> int:
    """Build several stages at the same time, each in a process of its own; the exit status.

    A stage is a chain of compiles, and one that has a single file (stage 01) keeps one core
    busy however many there are: so the stages are built side by side, as many at a time as
    MAX_JOBS allows, each with twice its share of MAX_JOBS. At most twice MAX_JOBS compilers run
    at once, and the stage still compiling when the others are done is not left with one job.
    The longest builds start first, except that a build whose files another compiles too, with
    the same flags, starts after it (_after), to find them in the compiler cache. Each stage
    writes its compiler output to its own build.log, and its lines of progress here.
    `emulated`: the CUDA stages' kernels for the emulated CUDA device too (workbook.build.emulate),
    which their tests would otherwise compile one after the other when they first need them.
    """
    tasks = _tasks(targets, force=force, require_cuda=require_cuda, emulated=emulated)
    slots = int(max_jobs())
    at_once = max(1, min(slots, len(tasks)))
    jobs = str(max(1, min(slots, 2 * slots // at_once)))
    queue = sorted(tasks, key=lambda task: task.weight, reverse=True)
    cache = compiler_cache()
    waits = {id(task): _after(task, tasks) if cache.startswith(("ccache (", "sccache")) else []
             for task in tasks}
    if len(queue) > 1:
        print(f"[build] {len(queue)} builds side by side, {at_once} at a time with MAX_JOBS="
              f"{jobs} each, the longest first (a build whose files another compiles too, after "
              f"it); compiler cache: {cache}", flush=True)
    start = time.perf_counter()
    running: dict[subprocess.Popen, _Task] = {}
    failed = []
    done: set[int] = set()
    while queue or running:
        while len(running) < at_once:
            ready = [task for task in queue if all(id(w) in done for w in waits[id(task)])]
            if not ready:
                break
            task = ready[0]
            queue.remove(task)
            env = dict(os.environ, MAX_JOBS=jobs, **task.env)
            running[subprocess.Popen(task.command, env=env)] = task
        time.sleep(0.2)
        for proc in [p for p in running if p.poll() is not None]:
            if proc.returncode:
                failed.append(running[proc].label)
                print(f"[build] {running[proc].label}: FAILED (see above)", flush=True)
            done.add(id(running.pop(proc)))
    if len(tasks) > 1:
        print(f"[build] {len(tasks)} builds done in {time.perf_counter() - start:.1f} s"
              + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Build workbook stages under build/.")
    parser.add_argument("stage", nargs="+",
                        help="stage numbers, folder names or paths, or `all`")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--require-cuda", action="store_true",
                        help="exit 1 when a CUDA stage cannot be built with its CUDA kernels "
                        "(skipped, or CPU-only): what a GPU machine's check wants")
    args = parser.parse_args(argv)
    if args.require_cuda:
        os.environ.setdefault(stages.NVCC, "1")
    every = args.stage == ["all"]
    targets = stages.all_stages() if every else [stages.get(s) for s in args.stage]
    # The stages' processes inherit the choice, and say nothing. Only a CUDA stage asks: the
    # question loads torch (seconds, before the first compile of `make verify 1`, say).
    chosen = emulate.choose_builds() if any(s.cuda for s in targets) else None
    if chosen:
        print(f"[build] {chosen}", flush=True)
    if args.require_cuda and any(s.cuda for s in targets) and cuda_toolkit() is None:
        print(f"[build] no CUDA toolkit for the CUDA stages: {toolkit.reason()}")
        return 1
    if len(targets) > 1:
        # `make test` builds all: where the CUDA tests will run on the emulated device, its
        # kernels are built here too, side by side with the rest.
        return build_side_by_side(targets, force=args.force, require_cuda=args.require_cuda,
                                  emulated=every and emulate.active())
    return _build_one(targets[0], force=args.force, require_cuda=args.require_cuda)


