"""The test suite: a pytest process per stage and for the repository's own tests (tests/).

    python -m workbook.testing.suite all       every stage and tests/, side by side  (make test)
    python -m workbook.testing.suite 5         stage 5's tests alone                (make stage 5)
    python -m workbook.testing.suite 5 -- -k opcheck -x       (pytest options after --)

The tests marked `template` (a stage generated or copied, then built and tested, in a copy of
the repository: minutes each) are left to `make test-template`, those marked `exercises`
(every stage carved, built and tested) to `make test-exercises`, those marked `book` (the
site `make book` built) to `make book-check`, and those marked `standalone` (a check run into an
empty build folder) to `make test-standalone`, which CI runs first.

Why a process per stage: a stage's package, and the op namespace a torch.library stage
registers, load once per process. Stages 06 and 07 both build `extops`, and a stage copied under
a new number builds its original's package again; each is tested in a process of its own.

Parts side by side: much of a test's time is single-threaded Python (gradcheck, opcheck, pytest
itself) or a one-file compile, so `all` runs WORKBOOK_TEST_JOBS parts at a time (default: the
cores, at most 3), the longest first by the last run's times (build/suite-times.json), each with
an equal share of the cores as its torch threads (OMP_NUM_THREADS, unless set): never more
threads than cores, which would make OpenMP's spinning threads wait on each other. A part marked
`alone` (the notebooks that time code: their figures want a quiet machine) runs when no other
does, with every core. Side by side, a part's output is printed whole when it ends, with a line
on what is running every minute; one part at a time (WORKBOOK_TEST_JOBS=1, or a single stage),
it streams. A summary table closes the run, and the exit status is 1 when any part failed (or
collected no tests).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from workbook.build import stages

REPO = stages.REPO
# Each part ends with its slowest tests (5 s and more, at most 8): where the suite's time goes.
PYTEST = [sys.executable, "-m", "pytest", "-q", "-rs", "--durations=8", "--durations-min=5"]
SUMMARY = re.compile(r"^=*\s*(\d+ \w+.*) in [\d.]+s")
EMULATED = re.compile(r"^\[emulated\] (\d+) CUDA tests ran on the emulated CUDA device")


@dataclasses.dataclass
class Part:
    label: str
    paths: list[Path]
    options: list[str] = dataclasses.field(default_factory=list)
    exit_code: int = -1
    alone: bool = False  # run when no other part runs (its tests time things)
    summary: str = ""
    seconds: float = 0.0
    emulated: int = 0  # how many of its tests ran on the emulated CUDA device (conftest.py)
    output: list[str] = dataclasses.field(default_factory=list)  # when not streamed

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


# glibc gives every freed block over 32 MiB back to the kernel, which zeroes its pages again on
# the next allocation: stage 05's tests spent a third of their time in the kernel (43 of 123 s
# at one thread, mostly the 65536-row LLTM cases), 8 s with these. The test processes keep freed
# memory for reuse (up to 1 GiB free at the heap's top) instead, at a higher peak (6.5 GB against
# 5.5). Where the environment sets glibc's malloc itself, it is left as it is.
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def env_for_pytest(env: dict[str, str]) -> dict[str, str]:
    """The environment of a pytest process run from `env`."""
    if any(k.startswith("MALLOC_") or k == "GLIBC_TUNABLES" for k in env):
        return dict(env, PYTHONUNBUFFERED="1")
    return {**MALLOC_ENV, **env, "PYTHONUNBUFFERED": "1"}


def _header(part: Part) -> str:
    return f"\n[test] ===== {part.label}: pytest {' '.join(_short(p) for p in part.paths)}"


def run_part(part: Part, extra: list[str], env: dict[str, str] | None = None,
             on_line: Callable[[str], None] | None = None, stream: bool = True) -> Part:
    """Run pytest on the part's paths, streaming its output (or, `stream=False`, keeping it in
    part.output); fill in the outcome. `env`: the environment of the pytest process
    (workbook.net.sanitize's, say), this one's by default; `on_line`: called with each line of
    output too (workbook.net.sanitize looks for reports)."""
    if stream:
        print(_header(part), flush=True)
    start = time.perf_counter()
    env = env_for_pytest(dict(os.environ if env is None else env))
    with subprocess.Popen([*PYTEST, *map(str, part.paths), *part.options, *extra], cwd=REPO,
                          env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            if stream:
                print(line, end="", flush=True)
            else:
                part.output.append(line)
            if on_line is not None:
                on_line(line)
            match = SUMMARY.match(line.strip())
            if match:
                part.summary = match.group(1)
            match = EMULATED.match(line.strip())
            if match:
                part.emulated = int(match.group(1))
    part.exit_code = proc.returncode
    part.seconds = time.perf_counter() - start
    if part.exit_code == 5:
        part.summary = "no tests collected (a stage must have test_*.py files)"
    return part


def _short(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


# tests/ without the marked tests that have targets of their own (see the module docstring).
TESTS_OPTIONS = ["-m", "not template and not exercises and not book and not standalone"]
NOTEBOOKS_TEST = REPO / "tests" / "test_notebooks.py"
# Its execution cases of the notebooks that time nothing (ids "untimed-<notebook>"), as -k takes
# them: they run beside the other parts, the rest of the file alone.
UNTIMED_NOTEBOOKS = "test_notebooks_execute and untimed"


def parts_for(targets: list[str]) -> list[Part]:
    """'all': every stage, tests/, and the notebooks (those that time code alone); else the
    stages named (numbers or folders)."""
    if targets == ["all"]:
        chosen = stages.all_stages()
        extra = [Part("tests/ (tools, benchmark, matrices)", [REPO / "tests"],
                      [*TESTS_OPTIONS, "--ignore", str(NOTEBOOKS_TEST)]),
                 Part("tests/test_notebooks.py: notebooks that time nothing", [NOTEBOOKS_TEST],
                      [*TESTS_OPTIONS, "-k", UNTIMED_NOTEBOOKS]),
                 Part("tests/test_notebooks.py (alone: they time code)", [NOTEBOOKS_TEST],
                      [*TESTS_OPTIONS, "-k", f"not ({UNTIMED_NOTEBOOKS})"], alone=True)]
    else:
        chosen, extra = [stages.get(t) for t in targets], []
    return [Part(s.label, [s.source_dir]) for s in chosen] + extra


# -- parts side by side -------------------------------------------------------------------------

TIMES = "suite-times.json"  # under the build folder: each part's seconds in the last run


def parts_at_a_time(cores: int | None = None) -> int:
    """How many parts run at a time: WORKBOOK_TEST_JOBS, else the cores (at most 3)."""
    from workbook.measure.timing import usable_cpus

    cores = len(usable_cpus()) if cores is None else cores
    wanted = os.environ.get("WORKBOOK_TEST_JOBS", "").strip()
    if wanted:
        if not wanted.isdigit() or int(wanted) < 1:
            raise ValueError(f"WORKBOOK_TEST_JOBS must be a whole number >= 1, got {wanted!r}")
        return int(wanted)
    return max(1, min(cores, 3))


def _last_times() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in
                json.loads((stages.build_root() / TIMES).read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _save_times(parts: list[Part]) -> None:
    times = {**_last_times(), **{p.label: round(p.seconds, 1) for p in parts if p.exit_code >= 0}}
    path = stages.build_root() / TIMES
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(times, indent=1, sort_keys=True) + "\n")


def schedule(parts: list[Part], last: dict[str, float]) -> list[Part]:
    """The order to start them in: longest first by `last` (a part not timed yet counts as
    long: tests/ first, then the stages newest first), the parts to run alone at the end."""
    rank = {id(p): k for k, p in enumerate(parts)}  # later parts first: tests/, stage 7, ...
    together = sorted((p for p in parts if not p.alone),
                      key=lambda p: (last.get(p.label, float("inf")), rank[id(p)]), reverse=True)
    return together + [p for p in parts if p.alone]


def run_side_by_side(parts: list[Part], extra: list[str], jobs: int, cores: int) -> None:
    """Run the parts `jobs` at a time (see the module docstring), printing each part's output
    whole as it ends and a line on what runs every minute."""
    threads = max(1, cores // jobs)
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(threads)
    print(f"[test] {len(parts)} parts, {jobs} at a time, {env['OMP_NUM_THREADS']} torch "
          f"thread(s) each on {cores} cores, the longest first; each part's output is printed "
          f"when it ends (WORKBOOK_TEST_JOBS=1: one at a time, streamed)", flush=True)
    lock = threading.Condition()
    running: dict[str, float] = {}
    queue = schedule(parts, _last_times())

    def one(part: Part) -> None:
        try:  # a part alone has every core: torch's own thread count, or the environment's
            run_part(part, extra, None if part.alone else env, stream=False)
        except Exception as error:  # noqa: BLE001 (reported as the part's failure)
            part.output.append(f"[test] could not run pytest: {error!r}\n")
            part.exit_code = 1
        with lock:
            print(_header(part), flush=True)
            print("".join(part.output), end="", flush=True)
            print(f"[test] {part.label}: {part.summary or f'exit {part.exit_code}'} "
                  f"in {part.seconds:.0f} s", flush=True)
            del running[part.label]
            lock.notify_all()

    workers: list[threading.Thread] = []
    with lock:
        while queue or running:
            if queue and (not running if queue[0].alone else len(running) < jobs):
                part = queue.pop(0)
                running[part.label] = time.perf_counter()
                workers.append(threading.Thread(target=one, args=(part,), daemon=True))
                workers[-1].start()
            elif not lock.wait(timeout=60):  # woken when a part ends, else a line a minute
                _say_running(running, len(parts) - len(queue) - len(running), len(parts))
    for worker in workers:
        worker.join()


def _say_running(running: dict[str, float], done: int, total: int) -> None:
    now = time.perf_counter()
    names = ", ".join(f"{label} ({now - since:.0f} s)" for label, since in running.items())
    print(f"[test] running: {names}; {done} of {total} parts done", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    targets = (argv[: argv.index("--")] if "--" in argv else argv) or ["all"]
    try:
        parts, jobs = parts_for(targets), parts_at_a_time()
    except (ValueError, stages.StageError) as error:
        print(f"[test] {error}", file=sys.stderr)
        return 2
    from workbook.build import emulate

    emulate.choose_builds()  # as `python -m workbook.build` chose, for the parts to inherit
    start = time.perf_counter()
    if jobs > 1 and len(parts) > 1:
        from workbook.measure.timing import usable_cpus

        run_side_by_side(parts, extra, min(jobs, len(parts)), len(usable_cpus()))
    else:
        for part in parts:
            run_part(part, extra)
    _save_times(parts)
    print("\n[test] ===== summary")
    for part in parts:
        status = "ok  " if part.ok else "FAIL"
        emulated = f" ({part.emulated} on the emulated CUDA device)" if part.emulated else ""
        outcome = (part.summary or f"exit {part.exit_code}") + emulated
        print(f"  {status} {part.label:<52} {outcome:<40} {part.seconds:6.0f} s")
    if any(p.emulated for p in parts):
        print("  (emulated: the CUDA kernels compiled for the CPU and run there, "
              "workbook.build.emulate; they prove arithmetic, indexing, launch limits and "
              "barriers, not GPU speed, its memory ordering or concurrency; races: make "
              "racecheck)")
    failed = [p for p in parts if not p.ok]
    total = time.perf_counter() - start
    if failed:
        print(f"[test] FAILED: {', '.join(p.label for p in failed)} ({total:.0f} s)")
        return 1
    print(f"[test] all {len(parts)} parts passed in {total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
