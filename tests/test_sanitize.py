"""The sanitizer pass (workbook.net.sanitize, `make sanitize`): its flags, its choice of stages,
and that a report would be seen.

The pass itself takes minutes and runs in CI as a step of its own. What is checked here, in
seconds, is the chain it rests on: code compiled with compiler.sanitizer_flags(), loaded by a
Python that preloads the runtimes with the pass's options, writes a report for a planted memory
error and a planted signed overflow (under setuptools' -fwrapv too), the process stops, and the
report is found in the output. No torch in the planted library: a plain C function called
through ctypes, compiled in well under a second.
"""

import os
import shutil
import subprocess
import sys

import pytest

from workbook.build import builder, compiler, stages
from workbook.net import sanitize

PLANTED = r"""
#include <climits>
#include <cstdlib>

extern "C" int read_past_the_end(int n) {
  int* values = static_cast<int*>(std::malloc(sizeof(int) * n));
  for (int i = 0; i < n; ++i) values[i] = i;
  int past = values[n];  // one element past the end of the allocation
  std::free(values);
  return past;
}

extern "C" int overflow(int by) {
  volatile int big = INT_MAX;
  return big + by;  // signed overflow
}

extern "C" int fine(int n) { return n + 1; }
"""

CALL = "import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); print(getattr(lib, sys.argv[2])(3))"


def compiler_and_runtimes():
    if shutil.which("g++") is None:
        pytest.skip("no g++ on PATH")
    try:
        return sanitize.runtimes()
    except SystemExit as missing:
        pytest.skip(str(missing))


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The planted library, compiled with the pass's flags after setuptools' -fwrapv."""
    preload = compiler_and_runtimes()
    folder = tmp_path_factory.mktemp("sanitize")
    (folder / "planted.cpp").write_text(PLANTED)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WORKBOOK_SANITIZE", "1")
        flags = compiler.sanitizer_flags()
    library = folder / "libplanted.so"
    subprocess.run(["g++", "-fPIC", "-shared", "-fwrapv", *flags, "planted.cpp", "-o",
                    library.name], cwd=folder, check=True)
    return library, preload


def call(planted, function: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    library, preload = planted
    env = sanitize.with_runtimes(dict(os.environ), preload)
    proc = subprocess.run([sys.executable, "-c", CALL, str(library), function], env=env,
                          capture_output=True, text=True, timeout=120)
    reports = sanitize.Reports()
    for line in (proc.stdout + proc.stderr).splitlines(keepends=True):
        reports(line)
    return proc, reports.texts()


def test_flags_only_when_asked(monkeypatch):
    monkeypatch.delenv("WORKBOOK_SANITIZE", raising=False)
    assert compiler.sanitizer_flags() == []
    assert not any("sanitize" in flag for flag in compiler.cxx_flags())
    monkeypatch.setenv("WORKBOOK_SANITIZE", "1")
    assert "-fsanitize=address,undefined,float-cast-overflow" in compiler.cxx_flags()
    # In the build record too: an instrumented library is never taken for an ordinary one.
    assert "-fsanitize=address" in builder.build_record()


def test_a_clean_call_reports_nothing(planted):
    proc, reports = call(planted, "fine")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "4"
    assert reports == []


def test_a_memory_error_is_reported_and_stops_the_process(planted):
    proc, reports = call(planted, "read_past_the_end")
    assert proc.returncode != 0
    assert len(reports) == 1, proc.stderr
    assert "AddressSanitizer: heap-buffer-overflow" in reports[0]
    assert reports[0].splitlines()[-1].startswith("SUMMARY: AddressSanitizer")
    assert "read_past_the_end" in reports[0]


def test_a_signed_overflow_is_reported_despite_fwrapv(planted):
    proc, reports = call(planted, "overflow")
    assert proc.returncode != 0
    assert len(reports) == 1, proc.stderr
    assert "runtime error: signed integer overflow" in reports[0]
    assert "in overflow" in reports[0]  # the stack names the function


def test_the_default_checks_the_stages_with_their_own_cpu_sources():
    every = stages.all_stages()
    default = [s for s in every if sanitize.why_not(s, full=False) is None]
    assert default, "the default pass would check no stage"
    for s in default:
        assert s.kind == "setup" and sanitize.own_cpu_sources(s) and (s.cpu_fallback or not s.cuda)
    for s in every:
        if s not in default:
            assert sanitize.why_not(s, full=False)  # a skipped stage says why


def test_the_builds_come_first_then_the_tests_side_by_side(monkeypatch, capsys):
    import time

    from workbook.measure.timing import usable_cpus

    picked = [s for s in stages.all_stages() if sanitize.why_not(s, full=False) is None][:2]
    events = []

    def build(s, base, preload):
        events.append(("build", s.label, time.perf_counter()))
        return sanitize.Result(s.label)

    def run_part(part, extra, env=None, on_line=None, stream=True):
        assert not stream, "side by side, a part's output is printed when it ends"
        start = time.perf_counter()
        time.sleep(0.5)
        part.output.append(f"the output of {part.label}\n")
        part.exit_code, part.summary = (1, "1 failed") if "fails" in env else (0, "1 passed")
        part.seconds = time.perf_counter() - start
        events.append(("test", part.label, start, time.perf_counter(), env["OMP_NUM_THREADS"]))
        return part

    monkeypatch.setattr(sanitize, "runtimes", lambda: ["/nonexistent/libasan.so"])
    monkeypatch.setattr(sanitize, "build_stage", build)
    monkeypatch.setattr(sanitize.suite, "run_part", run_part)
    monkeypatch.setenv("WORKBOOK_TEST_JOBS", "2")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert sanitize.main([str(s.number) for s in picked]) == 0
    builds = [e for e in events if e[0] == "build"]
    tests = [e for e in events if e[0] == "test"]
    assert [e[1] for e in builds] == [s.label for s in picked] and len(tests) == 2
    assert max(e[2] for e in builds) < min(e[2] for e in tests), "a test ran before a build"
    (_, _, start_a, end_a, threads), (_, _, start_b, end_b, _) = tests
    assert start_a < end_b and start_b < end_a, "the parts did not run side by side"
    assert threads == str(max(1, len(usable_cpus()) // 2))
    printed = capsys.readouterr().out
    assert all(f"the output of {s.label}" in printed for s in picked)
    assert "2 part(s) clean" in printed
    # A part that fails fails the pass.
    monkeypatch.setenv("fails", "1")
    assert sanitize.main([str(picked[0].number)]) == 1
    assert "FAILED" in capsys.readouterr().out
