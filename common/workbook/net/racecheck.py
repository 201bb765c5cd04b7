"""The race check: every CUDA kernel of every stage, run on the emulated CUDA device under
ThreadSanitizer, where each emulated thread is a thread of its own to the checker.

    python -m workbook.net.racecheck            every stage with CUDA kernels   (make racecheck)
    python -m workbook.net.racecheck 7 -- -x    the stages named; pytest options after --

compute-sanitizer's racecheck finds shared-memory hazards between a GPU's threads, on a GPU.
This is its counterpart without one:

* **The build.** ``WORKBOOK_RACECHECK=1`` compiles the stages' emulated kernels (their own .cu
  and .cuh files, workbook.build.emulate) with -fsanitize=thread into build/racecheck/, apart from
  the ordinary emulated builds. Nothing else is instrumented: not torch, not the stages' own
  libraries, which the pass uses as they are built for `make test`.
* **The run.** Every block's threads run as fibers on one CPU thread, each emulated thread a
  ThreadSanitizer fiber (emulated_cuda/block.h says what orders memory: a barrier, __syncwarp
  among its lanes, a launch's start and end; not atomics, which are relaxed as CUDA's are, nor
  shuffles). So two emulated threads that touch one address, shared or global, one of them
  writing, with no barrier between them, are a data race, reported with both lines and the
  kernel's name in their stacks. The runtime is preloaded (``LD_PRELOAD``: Python is not
  instrumented); ``ignore_noninstrumented_modules`` keeps torch's own memcpy and memset out of
  it. Each stage's CUDA tests run (``-m cuda``: every one that launches an emulated kernel),
  except those whose size is the point (``-k``, DEFAULT_DESELECT): the LLTM's 65536- and
  600000-row cases and its states of 1025 and 1500, and the deformable convolution's big inputs,
  whose millions of emulated threads run the launches the smaller cases run (under the checker
  the big inputs took 460 s of stage 07's 544, the two states 1300 s of stage 08's 1321: the
  checker's cost of a barrier grows with the threads it tells apart), and the float16 and
  bfloat16 cases: the same kernels, templated on the element type, meet the same barriers and
  touch the same addresses in the same order as float32's (their accumulators are float too);
  for the same reason a case that runs in float32 does not run again in float64
  (workbook.testing.pytest_emulated deselects the sibling; a case in float64 alone still runs);
  and the gradchecks, opchecks and torch.compile tests, which launch the kernels on the cases
  test_against_reference launches them on, only more times.
  Two stages run side by side (each on one CPU thread), as make test's parts do.
* **What it cannot see.** A race between two threads whose indices in the grid differ by a
  multiple of 1024 (threads share the checker's identities that way: creating one costs most of a
  millisecond), a race the checker's history has forgotten (it keeps the last few accesses to
  each 8 bytes), and everything the emulation cannot show (the GPU's weak memory ordering: a
  kernel that relies on a fence between blocks).

A stage whose kernel files are all another stage's, checked first (stage 06 compiles stage 05's
LLTM kernels and glue), is left out, saying so. Any report fails its stage, and is printed
again, shortened to the kernel's frames, after the stage's run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from workbook.build import emulate, stages
from workbook.build.stages import Stage
from workbook.testing import suite

TSAN_OPTIONS = {
    # torch's own code is not instrumented: its memcpy and memset calls are not the kernels'.
    "ignore_noninstrumented_modules": "1",
    # Reports are what the pass is for, not torch's locking order or its signal handlers.
    "detect_deadlocks": "0",
    "report_signal_unsafe": "0",
    # A report does not stop the run (the others are worth seeing); the exit status fails it.
    "halt_on_error": "0",
    "exitcode": "66",
}
DEFAULT_DESELECT = ("not b65536 and not b600000 and not s1025 and not s1500 and "
                    "not test_big_inputs and not float16 and not bfloat16 and "
                    "not test_gradcheck and not test_opcheck and not test_compile_fullgraph")
REPORT_START = re.compile(r"^WARNING: ThreadSanitizer: ")
REPORT_END = re.compile(r"^SUMMARY: ThreadSanitizer: ")
# A frame of the emulator's, below the kernel's own in a report's stacks.
EMULATOR_FRAME = re.compile(r"workbook::emulate::|emulated_cuda(?:\.h|/)")


@dataclass
class Result:
    label: str
    status: str = "skipped"  # "ok", "FAIL" or "skipped"
    note: str = ""
    seconds: float = 0.0
    reports: list[str] = field(default_factory=list)


class Reports:
    """Collects ThreadSanitizer's reports from output lines (suite.run_part's on_line)."""

    def __init__(self) -> None:
        self.found: list[list[str]] = []
        self._inside = False

    def __call__(self, line: str) -> None:
        text = line.rstrip("\n")
        if REPORT_START.match(text):
            self._inside = True
            self.found.append([])
        if self._inside:
            self.found[-1].append(text)
            if REPORT_END.match(text):
                self._inside = False

    def texts(self) -> list[str]:
        return [shorten(lines) for lines in self.found]


def shorten(lines: list[str]) -> str:
    """A report with each stack cut at the emulator's first frame (what calls the kernel) and the
    sections on how the checker's threads were created left out: the kernel's lines remain."""
    out, skipping_stack, skipping_section = [], False, False
    for text in lines:
        if text.startswith("  Thread T") and "created by" in text:
            skipping_section = True
            continue
        if skipping_section and (text.startswith("    #") or not text.strip()):
            continue
        skipping_section = False
        if text.startswith("    #"):
            if skipping_stack or EMULATOR_FRAME.search(text):
                skipping_stack = True
                continue
        else:
            skipping_stack = False
        out.append(text)
    return "\n".join(out)


@dataclass
class Race:
    """One data race ThreadSanitizer reported: the two accesses (what, file, line), innermost
    frame first, and the kernel they were in."""

    kernel: str
    accesses: list[tuple[str, str, int]]
    text: str

    def words(self) -> str:
        said = [f"{what} at {path}:{line}" for what, path, line in self.accesses]
        return f"a data race in `{self.kernel}`: {' and '.join(said)}, no barrier between them"


_ACCESS = re.compile(r"^\s+(?P<previous>Previous )?(?P<what>(?:atomic )?(?:[Ww]rite|[Rr]ead)) of "
                     r"size \d+")
_FRAME = re.compile(r"^\s+#0 (?P<function>[^(]+)\(.*\) (?P<path>\S+?):(?P<line>\d+)")


def races(texts: list[str]) -> list[Race]:
    """The races in ThreadSanitizer's reports (Reports.texts()): each access's innermost frame."""
    found = []
    for text in texts:
        accesses, kernel, pending = [], "", None
        for line in text.splitlines():
            if match := _ACCESS.match(line):
                pending = ("previous " if match["previous"] else "") + match["what"].lower()
            elif pending and (frame := _FRAME.match(line)):
                accesses.append((pending, frame["path"], int(frame["line"])))
                kernel = kernel or frame["function"].split("<")[0].split("::")[-1].strip()
                pending = None
        if accesses:
            found.append(Race(kernel, accesses, text))
    return found


# What make verify runs again under the checker: the small cases in float32 (and the tests that
# take no dtype), enough to meet every barrier of every kernel.
COPY_SELECTION = f"not float64 and not b70000 and {DEFAULT_DESELECT}"


def check_copy(pytest: list[str], env: dict[str, str], cwd: Path) -> tuple[int, list[Race]]:
    """Run a pytest command (make verify's, on a stage copy's tests) on the copy's emulated
    kernels built with ThreadSanitizer, the small cases only (COPY_SELECTION): its exit status
    and the races found. `env` is the copy's test environment; the checker's is added (the
    instrumented build goes to racecheck/ of the copy's build folder)."""
    checked = environment(runtime(), env)
    reports = Reports()
    cmd = [*pytest, "--capture=sys", "-m", "cuda", "-k", COPY_SELECTION]
    with subprocess.Popen(cmd, cwd=cwd, env=checked, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            reports(line)
    seen, distinct = set(), []  # one race reported by many threads, in many cases: once
    for race in races(reports.texts()):
        where = tuple(sorted((path, line) for _, path, line in race.accesses))
        if where not in seen:
            seen.add(where)
            distinct.append(race)
    return proc.returncode, distinct


def runtime() -> str:
    """The ThreadSanitizer runtime of the compiler that builds the kernels, to preload."""
    compiler = os.environ.get("CXX") or "g++"
    found = subprocess.run([compiler, "-print-file-name=libtsan.so"], capture_output=True,
                           text=True).stdout.strip()
    if not found or not Path(found).is_file():
        raise SystemExit(f"[racecheck] {compiler} has no libtsan.so (asked with "
                         f"-print-file-name=libtsan.so): install gcc's ThreadSanitizer runtime "
                         f"(on Debian/Ubuntu: libtsan2, or the gcc package)")
    return str(Path(found).resolve())


def environment(preload: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (this process's environment by default) as the pass wants it: emulated kernels
    instrumented (racecheck/ of its build folder), run emulated even where a GPU is visible, one
    CPU thread, the runtime preloaded."""
    base = dict(os.environ if base is None else base)
    return dict(base, WORKBOOK_RACECHECK="1", WORKBOOK_CUDA="emulate", OMP_NUM_THREADS="1",
                LD_PRELOAD=" ".join(filter(None, [preload, base.get("LD_PRELOAD", "")])),
                TSAN_OPTIONS=":".join(f"{k}={v}" for k, v in TSAN_OPTIONS.items()))


def kernel_files(s: Stage) -> set[Path]:
    return {p.resolve() for p in emulate.plan(s).sources if p.suffix == ".cu"}


def check_stage(s: Stage, env: dict[str, str], pytest_options: list[str]) -> Result:
    """Stage s's CUDA tests on its emulated kernels, built under ThreadSanitizer on import; the
    output is printed whole when they end (two stages run side by side)."""
    result = Result(s.label)
    reports = Reports()
    # --capture=sys: pytest captures what Python prints, not what the runtime writes to the file
    # descriptor, so a report is never held back with the output of a test that passes.
    part = suite.run_part(suite.Part(s.label, [s.source_dir], ["-m", "cuda", "--capture=sys"]),
                          pytest_options, env=env, on_line=reports, stream=False)
    result.seconds = part.seconds
    result.reports = reports.texts()
    result.note = part.summary or f"pytest exit {part.exit_code}"
    result.status = "ok" if part.ok and not result.reports else "FAIL"
    if result.reports:
        result.note = f"{len(result.reports)} race report(s); pytest: {result.note}"
    with _printing:
        print(f"\n[racecheck] ===== {s.label}: its CUDA tests on its emulated kernels under "
              f"ThreadSanitizer (built in {stages.build_root() / 'racecheck' / s.folder})",
              flush=True)
        print("".join(part.output), end="", flush=True)
        for number, text in enumerate(result.reports, 1):
            print(f"\n[racecheck] ----- {s.label}: report {number} of {len(result.reports)}\n"
                  f"{text}", flush=True)
    return result


_printing = threading.Lock()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stages", nargs="*", help="stage numbers or folders (default: every "
                        "stage with CUDA kernels)")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    try:
        chosen = [stages.get(t) for t in args.stages] if args.stages else [
            s for s in stages.all_stages() if s.cuda]
    except (ValueError, stages.StageError) as error:
        print(f"[racecheck] {error}", file=sys.stderr)
        return 2
    preload = runtime()
    env = environment(preload)
    pytest_options = ["-k", DEFAULT_DESELECT, *extra]
    print(f"[racecheck] the CUDA tests of {', '.join(s.label for s in chosen)} on the emulated "
          f"device under ThreadSanitizer ({preload}; TSAN_OPTIONS={env['TSAN_OPTIONS']}; -k "
          f"{DEFAULT_DESELECT!r}); fibers: {emulate.fibers()}", flush=True)
    start = time.perf_counter()
    results, covered, checked = {}, {}, []  # covered: kernel file -> the stage that checks it
    for s in chosen:
        files = kernel_files(s)
        if files and files <= covered.keys() and not args.stages:
            reason = f"its kernel files are {covered[min(files)]}'s, checked there"
            print(f"[racecheck] {s.label}: skipped: {reason}", flush=True)
            results[s.label] = Result(s.label, note=reason)
            continue
        checked.append(s)
        for f in files:
            covered.setdefault(f, s.label)
    built = subprocess.run([sys.executable, "-m", "workbook.build",
                            *(str(s.source_dir) for s in checked)])
    if built.returncode != 0:
        print(f"[racecheck] the stages' own build failed (exit {built.returncode})")
        return 1
    with concurrent.futures.ThreadPoolExecutor(max_workers=suite.parts_at_a_time()) as pool:
        for result in pool.map(lambda s: check_stage(s, env, pytest_options), checked):
            results[result.label] = result
    total = time.perf_counter() - start
    print("\n[racecheck] ===== summary (ThreadSanitizer over the emulated kernels)")
    results = [results[s.label] for s in chosen]
    for r in results:
        took = f"{r.seconds:5.0f} s" if r.seconds else ""
        print(f"  {r.status:<7} {r.label:<34} {took:<8} {r.note}")
    failed = [r for r in results if r.status == "FAIL"]
    if failed:
        print(f"[racecheck] FAILED: {', '.join(r.label for r in failed)} ({total:.0f} s)")
        return 1
    print(f"[racecheck] {sum(r.status == 'ok' for r in results)} stage(s) race-free under "
          f"ThreadSanitizer in {total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
