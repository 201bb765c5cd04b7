"""The sanitizer pass: the stages' C++ built with AddressSanitizer and UndefinedBehaviorSanitizer
into a build folder of its own, and each stage's tests run against that build.

    python -m workbook.net.sanitize            the default selection        (make sanitize)
    python -m workbook.net.sanitize --full     every stage, every test (make sanitize FULL=1)
    python -m workbook.net.sanitize 5 -- -x    the stages named; pytest options after -- (a
                                                   -k there replaces the default's)

How it works:

* **The build.** ``WORKBOOK_SANITIZE=1`` adds -fsanitize=address,undefined to the flags every
  extension is compiled with (`workbook.build.compiler.sanitizer_flags` lists them and says why).
  ``WORKBOOK_BUILD_DIR`` points at build/sanitize/, so the instrumented libraries land in
  build/sanitize/stages/<stage> and build/sanitize/jit, apart from the ordinary ones. The tests
  import their stage through `workbook.build.loader.import_stage`, which reads the same variables:
  it finds the instrumented library, and the build record (which holds the flags) tells it the
  library is current, so nothing uninstrumented is built or loaded behind the pass's back.
* **CPU only, CUDA kernels emulated.** ASan instruments host code; nvcc's device code is not.
  So a stage with a CPU fallback is built CPU-only (``WORKBOOK_NO_CUDA=1``), and the GPUs are
  hidden (``CUDA_VISIBLE_DEVICES=``) so that a GPU machine runs the same pass as a CPU one. The
  stages' CUDA tests then run on the emulated CUDA device (workbook.build.emulate), whose kernels
  are the stages' own .cu files compiled by the host compiler, with the same flags: instrumented,
  so a kernel thread that reads or writes past a buffer is reported at that load or store (our
  stand-in for compute-sanitizer's memcheck; tests/test_emulate.py plants one in stage 07's
  sampling kernel and checks it is reported).
* **The run.** Python is not instrumented, so the runtimes (the libasan and libubsan of the gcc
  that compiled the stages) are preloaded with ``LD_PRELOAD``: ASan has to be the first library
  in the process to take over malloc and free, and the instrumented extension finds its
  ``__asan_*`` and ``__ubsan_*`` functions there when it loads. An ahead-of-time build runs
  without them (the compiler needs none); a just-in-time stage is built by importing it, so
  with them. ``ASAN_OPTIONS``:

  - ``detect_leaks=0``: at exit LeakSanitizer reports every allocation nothing points to any
    more, and CPython and torch leave many such on purpose (interned objects, caches, the op
    registry: the OS frees them at exit): thousands of reports that are not bugs, among which a
    real one would not be seen. A leak in an op shows as memory growing over calls, which is a
    different test.
  - ``abort_on_error=1`` (``UBSAN_OPTIONS`` too): a report ends in abort(), so pytest's
    faulthandler prints the Python stack under it, which names the test that hit it.

  ``UBSAN_OPTIONS``: ``print_stacktrace=1`` (the report says where, not only what) and
  ``halt_on_error=1``.
* **The reports** go to stderr, and pytest runs with ``--capture=sys``: it captures what Python
  prints, not what the runtimes write to the file descriptor, so a report is never held back in
  the capture of a process that then dies. Every report in the output fails its stage and is
  printed again after the stage's run. (``log_path`` would put them in files, but with both
  runtimes preloaded UBSan's setting of it lands in ASan's copy of the function, and UBSan keeps
  writing to stderr.) A subprocess a test starts inherits the runtimes; its report fails that
  test, in the test's own output (a matrix row's child: the row fails as a crash, exit status -6,
  with the end of the child's stderr).
* **The order.** Every stage is built first, one at a time (each build has every core); then the
  tests run as parts side by side, as `make test`'s do (one per core, at most three;
  WORKBOOK_TEST_JOBS=1: one at a time), each with its share of the cores as torch threads, its
  output and its reports printed whole when it ends.
* **Stop at the first report.** A memory error leaves the heap in no known state, so ASan stops
  the process (going on needs -fsanitize-recover=address, and what follows means little).
  Undefined behaviour stops it too: -fno-sanitize-recover makes every check fatal in the library
  itself, whatever the environment says, so no report scrolls by in a test that passes, or gets
  lost with UBSAN_OPTIONS on its way to a subprocess. The cost is one finding per run.

**What the default checks, and FULL.** The default builds each stage whose C++ CPU sources are its
own and built ahead of time (01, 02, 05, 06, 09 and 10 today) and runs its tests, their emulated
CUDA kernels included, then the hostile-input matrices (tests/test_matrix.py, whose rows run in
child processes that inherit the runtimes) on those builds, and the cooperating threads' kernels
(tests/test_cooperation.py: fibers under ASan, each switch of stack told to it). It leaves out
(``-k``, DEFAULT_DESELECT) the tests that run no kernel code the others do not run, and whose
cost is their size or a compiler:

  - the gradchecks: under ASan every allocation goes through its allocator, so an op call costs
    about ten times more, and a full gradcheck calls the op twice per input element (the
    numerical Jacobian): they took 345 s of stage 06's 412, and about 75 s in each LLTM stage,
    against 10 to 16 s each without the sanitizers. test_against_reference runs the same forward
    and backward on every case in every dtype, gradients compared with the float64 reference;
  - the emulated LLTM cases of 65536 and 600000 rows and the deformable convolution's big inputs
    (``test_big_inputs``): millions of emulated threads running the launches the smaller cases
    run;
  - the deployment paths (``test_deploy``, ``test_deploy_ms_deform_attn``: TorchScript,
    checkpoints, ONNX, torch.export, an AOTInductor package, DDP), torch.compile
    (``test_compile_fullgraph``), the import from a bare interpreter (``imports_from_anywhere``)
    and the other projects' models and call forms (stage 10's ``test_integrations``): they call
    the ops with the inputs the stage's own tests use, through torch's machinery (whose C++
    compiles, Inductor's, would run under the preloaded runtimes) or another project's; make test
    checks what they say about packaging and about those projects.

FULL=1 runs every test; adds a just-in-time stage (03:
stage 02's C++ again, and a `load_inline` extension built and loaded under the sanitizers), a stage
built from another stage's sources (07: stage 06's CPU kernels, CPU-only, with its package-level
tests) and, where nvcc is found, a CUDA-only stage (04: its nvcc build's C++ front is instrumented,
and its tests run its kernels on the emulated device, instrumented as well); and runs the short
fuzzing profile and the concurrency test on the production build: about 22 minutes on the same
machine, more than CI has room for (stage 07's emulated deformable-convolution kernels included:
under the default pass, tests/test_emulate.py runs one planted bug in them under ASan).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from workbook.build import stages, toolkit
from workbook.build.stages import Stage, build_root
from workbook.measure.timing import usable_cpus
from workbook.testing import suite

ASAN_OPTIONS = {"detect_leaks": "0", "abort_on_error": "1"}
UBSAN_OPTIONS = {"print_stacktrace": "1", "halt_on_error": "1", "abort_on_error": "1"}
# The tests the default pass leaves out (a pytest -k expression); the docstring says why.
DEFAULT_DESELECT = ("not test_gradcheck and not b65536 and not b600000 and not test_big_inputs "
                    "and not test_deploy and not test_compile_fullgraph "
                    "and not imports_from_anywhere and not test_integrations")
# The repository's tests that drive the stages' C++ with hostile or random inputs, and the
# emulated device's fibers, run on the instrumented builds after the stages: the hostile-input
# matrices and the cooperating kernels by default (they need the default's stages), with FULL the
# fuzzing (short profile) and the concurrency test too (they need the production stage, which
# FULL builds).
RELIABILITY = ["tests/test_matrix.py", "tests/test_cooperation.py"]
RELIABILITY_FULL = RELIABILITY + ["tests/test_fuzz.py", "tests/test_concurrency.py"]
# The first line of a report: ASan's "==123==ERROR: AddressSanitizer: heap-buffer-overflow ...",
# which ends at its "SUMMARY: AddressSanitizer: ..." line; UBSan's "file.cpp:12:5: runtime error:
# signed integer overflow ...", which ends with its stack (a fatal check prints no SUMMARY).
ASAN_START = re.compile(r"==\d+==ERROR: \w+Sanitizer")
UBSAN_START = re.compile(r": runtime error: ")
SUMMARY = re.compile(r"^SUMMARY: \w+Sanitizer")
FRAME = re.compile(r"^\s+#\d+ ")


@dataclass
class Result:
    label: str  # "stage 5 (05_cuda_accessors)", or the test files of a reliability part
    status: str = "skipped"  # "ok", "FAIL" or "skipped"
    note: str = ""  # the pytest summary, or why the part was skipped or failed
    build_s: float = 0.0  # wall-clock seconds
    test_s: float = 0.0
    build_cpu_s: float = 0.0  # CPU seconds of the build's processes
    reports: list[str] = field(default_factory=list)


class Reports:
    """Collects the sanitizer reports from a stream of output lines (suite.run_part's on_line)."""

    def __init__(self) -> None:
        self.found: list[list[str]] = []
        self._in = ""  # "asan" or "ubsan" inside a report, "" outside

    def __call__(self, line: str) -> None:
        text = line.rstrip("\n")
        if self._in == "ubsan" and not FRAME.match(text):
            self._in = ""
        if not self._in:
            self._in = "asan" if ASAN_START.search(text) else "ubsan" if UBSAN_START.search(
                text) else ""
            if not self._in:
                return
            self.found.append([])
        self.found[-1].append(text)
        if self._in == "asan" and SUMMARY.match(text):
            self._in = ""

    def texts(self) -> list[str]:
        return ["\n".join(lines) for lines in self.found]


def root() -> Path:
    """build/sanitize/ under the ordinary build folder (read before the pass moves it)."""
    return build_root() / "sanitize"


def runtimes() -> list[str]:
    """The sanitizer runtimes of the compiler that builds the stages, to preload."""
    compiler = os.environ.get("CXX") or "g++"
    found = []
    for name in ("libasan.so", "libubsan.so"):
        out = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True,
                             text=True).stdout.strip()
        if not out or not Path(out).is_file():
            raise SystemExit(f"[sanitize] {compiler} has no {name} (asked with "
                             f"-print-file-name={name}): install gcc's sanitizer runtimes "
                             f"(on Debian/Ubuntu: libasan8 libubsan1, or the gcc package)")
        found.append(str(Path(out).resolve()))
    return found


def own_cpu_sources(s: Stage) -> list[Path]:
    """The C++ files in stage s's own folder (stage 06's deform_conv2d, stage 10's glue), beside
    those it compiles from other stages (sources_from)."""
    return sorted(s.source_dir.rglob("*.cpp"))


def why_not(s: Stage, full: bool) -> str | None:
    """Why stage s is left out of this pass; None when it is checked."""
    if s.cuda and not s.cpu_fallback:
        if not full:
            return ("CUDA-only: its kernels are device code, which ASan does not instrument "
                    "(FULL=1 builds its C++ front where nvcc is found)")
        if toolkit.find() is None:
            return f"CUDA-only, and no CUDA toolkit to build it with: {toolkit.reason()}"
    if not full and s.sources_from and not own_cpu_sources(s):
        return (f"its CPU sources are {', '.join(s.sources_from)}'s, checked there (FULL=1 "
                f"builds it too)")
    if not full and s.kind == "jit":
        return ("built just in time from another stage's C++, checked there (FULL=1 checks the "
                "just-in-time build too)")
    return None


def environment(base: Path, cpu_only: bool = True) -> dict[str, str]:
    """The environment of the pass: instrumented builds under build/sanitize, no GPU, and
    CPU-only builds unless `cpu_only` is False (a CUDA-only stage: its C++ front is instrumented,
    nvcc does the rest)."""
    env = dict(os.environ, WORKBOOK_SANITIZE="1", WORKBOOK_BUILD_DIR=str(base),
               TORCH_EXTENSIONS_DIR=str(base / "jit"),
               TORCHINDUCTOR_CACHE_DIR=str(base / "inductor"), CUDA_VISIBLE_DEVICES="")
    if cpu_only:
        env["WORKBOOK_NO_CUDA"] = "1"
    return env


def with_runtimes(env: dict[str, str], preload: list[str]) -> dict[str, str]:
    """env, plus the runtimes preloaded and their options."""
    def options(values: dict[str, str]) -> str:
        return ":".join(f"{k}={v}" for k, v in values.items())

    return dict(env, LD_PRELOAD=" ".join(preload + [env.get("LD_PRELOAD", "")]).strip(),
                ASAN_OPTIONS=options(ASAN_OPTIONS), UBSAN_OPTIONS=options(UBSAN_OPTIONS))


def children_cpu() -> float:
    """CPU seconds (user + system) used so far by this process's finished children: beside the
    wall time, a measure a busy machine does not inflate."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_tests(result: Result, paths: list[Path], env: dict[str, str],
              pytest_options: list[str]) -> Result:
    """pytest on `paths` under the runtimes (env has them); fills in result. Parts run side by
    side (main), so the output is printed whole when the part ends, reports after it. (Their
    CPU seconds are not told apart: main gives the sum.)"""
    with _printing:
        print(f"[sanitize] {result.label}: testing ...", flush=True)
    reports = Reports()
    part = suite.run_part(suite.Part(result.label, paths, ["--capture=sys"]), pytest_options,
                          env=env, on_line=reports, stream=False)
    result.test_s = part.seconds
    result.reports = reports.texts()
    result.note = part.summary or f"pytest exit {part.exit_code}"
    result.status = "ok" if part.ok and not result.reports else "FAIL"
    if result.reports:
        result.note = f"{len(result.reports)} sanitizer report(s); pytest: {result.note}"
    with _printing:
        print(f"\n[sanitize] ===== {result.label}: its tests under the sanitizers (LD_PRELOAD="
              f"{env['LD_PRELOAD']}, ASAN_OPTIONS={env['ASAN_OPTIONS']}, UBSAN_OPTIONS="
              f"{env['UBSAN_OPTIONS']}), {part.seconds:.0f} s", flush=True)
        print("".join(part.output), end="", flush=True)
        for number, text in enumerate(result.reports, 1):
            print(f"\n[sanitize] ----- {result.label}: sanitizer report {number} of "
                  f"{len(result.reports)} (the test it ran in: the Python stack above it)\n"
                  f"{text}", flush=True)
    return result


_printing = threading.Lock()


def build_stage(s: Stage, base: Path, preload: list[str]) -> Result:
    """Build stage s instrumented (its output streamed: builds run one at a time, each with
    every core). A just-in-time stage is built by importing it, so under the runtimes."""
    result = Result(s.label)
    env = stage_environment(s, base)
    cpu_only = s.cuda and s.cpu_fallback  # built as Stage.cpu_only_build() says
    where = base / ("jit" if s.kind == "jit" else f"stages{'-cpu' * cpu_only}/{s.folder}")
    print(f"\n[sanitize] ===== {s.label}: building with ASan+UBSan into {where} ...", flush=True)
    start, cpu = time.perf_counter(), children_cpu()
    built = subprocess.run([sys.executable, "-m", "workbook.build", str(s.source_dir)],
                           env=with_runtimes(env, preload) if s.kind == "jit" else env)
    result.build_s, result.build_cpu_s = time.perf_counter() - start, children_cpu() - cpu
    if built.returncode != 0:
        result.status, result.note = "FAIL", f"build failed (exit {built.returncode})"
    return result


def stage_environment(s: Stage, base: Path) -> dict[str, str]:
    """The pass's environment for stage s: CPU-only unless it is a CUDA-only stage."""
    return environment(base, cpu_only=s.cpu_fallback or not s.cuda)


def stage_tests(s: Stage, result: Result, base: Path, preload: list[str],
                pytest_options: list[str], env: dict[str, str]) -> Result:
    """Stage s's tests under the runtimes, on its instrumented build (build_stage's)."""
    sanitized = with_runtimes(dict(stage_environment(s, base), **env), preload)
    return run_tests(result, [s.source_dir], sanitized, pytest_options)


def check_reliability(files: list[str], base: Path, preload: list[str],
                      pytest_options: list[str], env: dict[str, str]) -> Result:
    """The repository's tests that drive the stages' C++ with hostile or random inputs, on the
    instrumented builds (which the stage checks built; one still missing is built on import)."""
    paths = [stages.REPO / f for f in files]
    result = Result(f"tests/ ({', '.join(p.stem.removeprefix('test_') for p in paths)})")
    missing = [f for f, p in zip(files, paths) if not p.is_file()]
    if missing:
        result.note = f"not found: {', '.join(missing)}"
        return result
    return run_tests(result, paths, with_runtimes(dict(environment(base), **env), preload),
                     pytest_options)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stages", nargs="*", help="stage numbers or folders, checked whatever the "
                        "default would skip (default: the default selection, or every stage "
                        "with --full)")
    parser.add_argument("--full", action="store_true",
                        help="every stage with C++ to check, and every test")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    try:
        chosen = [stages.get(t) for t in args.stages] if args.stages else stages.all_stages()
    except (ValueError, stages.StageError) as error:
        print(f"[sanitize] {error}", file=sys.stderr)
        return 2
    base = root()
    preload = runtimes()
    pytest_options = ([] if args.full else ["-k", DEFAULT_DESELECT]) + extra
    selection = ("FULL: every stage, every test" if args.full else
                 f"default selection (tests: -k {DEFAULT_DESELECT!r}; FULL=1 runs them all)")
    print(f"[sanitize] {selection}; ASan+UBSan builds in {base}; runtimes {' '.join(preload)}",
          flush=True)
    start, cpu = time.perf_counter(), children_cpu()
    results, checked = {}, []
    for s in chosen:
        reason = why_not(s, args.full or bool(args.stages))  # a stage named is checked
        if reason:
            print(f"\n[sanitize] ===== {s.label}: skipped: {reason}", flush=True)
            results[s.label] = Result(s.label, note=reason)
        else:
            results[s.label] = build_stage(s, base, preload)
            checked += [s] if results[s.label].status != "FAIL" else []
    # The tests, `jobs` parts side by side (each with its share of the cores), the reliability
    # tests among them: every stage they load is built by now.
    jobs = suite.parts_at_a_time()
    env = {} if "OMP_NUM_THREADS" in os.environ else {
        "OMP_NUM_THREADS": str(max(1, len(usable_cpus()) // jobs))}
    work = [lambda s=s: stage_tests(s, results[s.label], base, preload, pytest_options, env)
            for s in checked]
    if not args.stages:
        files = RELIABILITY_FULL if args.full else RELIABILITY
        work.append(lambda: check_reliability(files, base, preload, pytest_options, env))
    print(f"\n[sanitize] testing {len(work)} part(s), {jobs} at a time; each part's output is "
          f"printed when it ends", flush=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for result in pool.map(lambda run: run(), work):
            results[result.label] = result
    results = list(results.values())
    total = time.perf_counter() - start

    cpu = children_cpu() - cpu
    print(f"\n[sanitize] ===== summary (ASan+UBSan): wall-clock seconds (CPU seconds of the "
          f"builds, one at a time, in brackets; tests ran {jobs} at a time)")
    for r in results:
        built = f"build {r.build_s:4.0f} ({r.build_cpu_s:4.0f}), " if r.build_s else ""
        times = f"{built:<18}tests {r.test_s:4.0f}" if r.test_s else built
        print(f"  {r.status:<7} {r.label:<34} {times:<30} {r.note}")
    failed = [r for r in results if r.status == "FAIL"]
    if failed:
        print(f"[sanitize] FAILED: {', '.join(r.label for r in failed)} "
              f"({total:.0f} s, {cpu:.0f} CPU s)")
        return 1
    checked = sum(r.status == "ok" for r in results)
    print(f"[sanitize] {checked} part(s) clean under ASan+UBSan in {total:.0f} s "
          f"({cpu:.0f} CPU s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
