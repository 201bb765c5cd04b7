"""A build that fails stops there: its compiler's first error is the message, and no library an
earlier build left is loaded in its place (issue 37: a learner's compile error came back as wrong
maths from the previous build).

* The emulated kernels (workbook.build.emulate): torch's loader, asked again in one process for
  sources it saw fail, skips the build and loads the library in the folder. A small kernel of
  its own (no torch headers: it compiles in seconds) builds, then breaks.
* An ahead-of-time build (workbook.build.builder): a failure is remembered, so the next test's
  import fails at once instead of compiling again, until a source changes. setup.py is not run
  here (a stand-in reports a compiler error): the memory is what is checked.
"""

import os
import re
import subprocess
import sys

import pytest

from workbook.build import builder, stages

# Of the stages, it builds stage 1 (its kept results, workbook.testing.pytest_results, stand while
# that is unchanged).
pytestmark = pytest.mark.reaches(stages.get(1).folder)

STALE_KERNEL = r"""
#include <cuda_runtime.h>

__global__ void fill_kernel(double* out, double value) { out[threadIdx.x] = value; }

extern "C" double answer() {
  double out[4] = {0, 0, 0, 0};
  fill_kernel<<<1, 4>>>(out, VALUE);
  return out[0] + out[1] + out[2] + out[3];
}
"""

STALE_CHECKS = r"""
import ctypes, sys
from pathlib import Path
from workbook.build import emulate
source, build = Path(sys.argv[1]), Path(sys.argv[2])
for attempt in (1, 2):  # the second load is the one torch's loader answers with the old library
    try:
        emulate.build_kernels("emulate_stale_test", [source], build)
    except emulate.BuildFailed as error:
        print(f"attempt {attempt}: BuildFailed: {error}")
    else:
        lib = ctypes.CDLL(str(build / "objects" / "emulate_stale_test.so"))
        lib.answer.restype = ctypes.c_double
        print(f"attempt {attempt}: loaded, answer {lib.answer()}")
print("libraries left:", sorted(p.name for p in (build / "objects").glob("*.so")))
"""


@pytest.mark.cuda
def test_a_failed_build_is_reported_with_the_compilers_line_and_no_stale_library_is_loaded():
    """A kernel that built (answer 4), then a compile error in it: each later load in a fresh
    process fails with gcc's line in the source, and nothing of the first build is loaded."""
    folder = stages.empty_build_folder("test-emulate", "stale")
    source, build = folder / "stale.cu", folder / "build"
    source.write_text(STALE_KERNEL.replace("VALUE", "1.0"))
    first = subprocess.run([sys.executable, "-c", STALE_CHECKS, str(source), str(build)],
                           capture_output=True, text=True, timeout=900)
    assert "attempt 1: loaded, answer 4.0" in first.stdout, first.stdout + first.stderr[-3000:]
    source.write_text(STALE_KERNEL.replace("VALUE", "undeclared_value"))
    second = subprocess.run([sys.executable, "-c", STALE_CHECKS, str(source), str(build)],
                            capture_output=True, text=True, timeout=900)
    out = second.stdout
    for attempt in (1, 2):
        assert re.search(rf"attempt {attempt}: BuildFailed: building emulate_stale_test .* "
                         rf"failed: .*stale\.cu:8:\d+: error: .undeclared_value. was not "
                         rf"declared", out), out + second.stderr[-3000:]
    assert "loaded, answer" not in out, out
    assert "libraries left: []" in out, out


def test_a_failed_ahead_of_time_build_fails_again_at_once_until_a_source_changes(monkeypatch,
                                                                                    tmp_path):
    monkeypatch.setenv("WORKBOOK_BUILD_DIR", str(tmp_path))  # stage 01's build folder: here
    monkeypatch.setattr(builder, "_failed", {})
    stage = stages.get(1)
    runs = []

    def setup_py(cmd, cwd, env, stdout, stderr):
        runs.append(cmd)
        stdout.write("z2xy.cpp:7:12: error: 'sigmoid' was not declared in this scope\n")
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(builder.subprocess, "run", setup_py)
    for _ in range(3):
        with pytest.raises(builder.BuildFailed, match=r"^building stage 1 \(01_z2xy\) failed: "
                                                      r"z2xy.cpp:7:12: error: 'sigmoid'"):
            builder.build_stage(stage, quiet=True)
    assert len(runs) == 1, "the failed build was run again with the same sources"
    source = next(p for p in builder._sources(stage) if p.suffix == ".cpp")
    monkeypatch.setattr(builder, "_sources_state", lambda s: (("edited", str(source)),))
    with pytest.raises(builder.BuildFailed):
        builder.build_stage(stage, quiet=True)
    assert len(runs) == 2, "a changed source must be built again"


def test_the_first_errors_name_the_file_from_the_repository(tmp_path):
    """The compiler cache hands the compiler paths relative to the folder it runs in, so gcc's
    line says ../../../../stages/...: the first errors show such a path from the repository (a
    learner's copy under build/exercises/ is then the path make verify rewrites to theirs)."""
    where = stages.build_root() / "test-first-errors" / "temp"
    where.mkdir(parents=True, exist_ok=True)
    source = stages.REPO / "stages" / stages.get(1).folder / "csrc" / "z2xy.cpp"
    relative = os.path.relpath(source, where)  # ../../../stages/01_z2xy/csrc/z2xy.cpp
    log = (f"[1/2] c++ -c {relative}\n{relative}:79:14: error: 'thing' was not declared\n"
           "../../nowhere.cpp:1:1: error: not a file here\n")
    shown = builder.first_errors(log, where=where).splitlines()
    assert shown[1] == f"stages/{stages.get(1).folder}/csrc/z2xy.cpp:79:14: error: 'thing' " \
                       "was not declared"
    assert shown[2] == "../../nowhere.cpp:1:1: error: not a file here"  # left as written
    assert builder.first_errors(log).splitlines()[1].startswith(relative)
